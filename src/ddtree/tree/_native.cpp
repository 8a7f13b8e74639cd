// Compiled tree core: best-first build, verify-mask fill and the greedy accept walk.
//
// Plain CPython C API, no numpy or torch headers: the Python wrapper (ddtree/tree/native.py)
// validates every tensor (device, dtype, shape, strides) and passes raw data pointers and
// element strides; this file only reads and writes those buffers. Each function mirrors a
// Python reference operation for operation, so results are bit-identical:
//   build_tree    <- ddtree.tree.build._build_tree_python (heap, float64 path scores)
//   fill_layout   <- ddtree.tree.mask.fill_layout_torch (additive mask, positions)
//   accept_greedy <- ddtree.tree.accept._accept_greedy_torch (walk by match)
// The GIL is released while a function works on the buffers.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr long kAbiVersion = 1;  // bump when an argument list changes (native.py checks it)

// Status codes returned by build_tree besides a node count (the wrapper names the input).
constexpr long kNaN = -1;
constexpr long kUnsorted = -2;

// Read N integer arguments (pointers travel as integers) from a METH_FASTCALL call.
bool parse_ints(const char* name, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t want,
                long long* out) {
  if (nargs != want) {
    PyErr_Format(PyExc_TypeError, "%s takes %zd integer arguments, got %zd", name, want, nargs);
    return false;
  }
  for (Py_ssize_t i = 0; i < want; ++i) {
    out[i] = PyLong_AsLongLong(args[i]);
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

template <typename T>
T* ptr(long long address) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// ---------------------------------------------------------------------------------------------
// build_tree
//
// The Python heap pops (-score, rank key, ...) tuples; the rank key is the rank tuple as one
// base-(K+1) integer, so ties in score go to the lexicographically smaller rank tuple (a
// prefix before its extensions). Python integers do not overflow; here (K+1)^L would, so the
// tie-break compares the rank tuples themselves, kept per node ([M, L] int32). Scores are the
// same float64 operations in the same order: a sibling's key is -(score[parent] + lp[d][r+1]),
// a first child's key is key[node] - lp[d][0], a node's score is -key.

struct Candidate {
  double neg_score;  // -(path score)
  int32_t parent;    // node index of the parent
  int32_t depth;     // 1-based depth of the candidate
  int32_t rank;      // rank in its depth's list
};

struct BuildState {
  int64_t n_depth;
  std::vector<int32_t> ranks;  // [cap, L]: rank tuple of each node (depth entries used)

  // Rank tuple of candidate c at position i < c.depth.
  int32_t rank_at(const Candidate& c, int32_t i) const {
    return i + 1 == c.depth ? c.rank : ranks[static_cast<size_t>(c.parent) * n_depth + i];
  }

  // True when a is popped after b (std heaps keep the "largest" on top).
  bool after(const Candidate& a, const Candidate& b) const {
    if (a.neg_score != b.neg_score) return a.neg_score > b.neg_score;
    const int32_t common = std::min(a.depth, b.depth);
    for (int32_t i = 0; i < common; ++i) {
      const int32_t ra = rank_at(a, i), rb = rank_at(b, i);
      if (ra != rb) return ra > rb;
    }
    return a.depth > b.depth;  // a proper prefix comes first
  }
};

// NaN anywhere, else a row not sorted descending (the order check_topk reports them in). No
// early exit, so the contiguous case vectorises.
template <typename F>
long check_values(const F* lp, int64_t n_depth, int64_t k, int64_t row_stride,
                  int64_t col_stride) {
  bool nan = false, unsorted = false;
  for (int64_t d = 0; d < n_depth; ++d) {
    const F* row = lp + d * row_stride;
    if (col_stride == 1) {
      for (int64_t r = 0; r < k; ++r) nan |= row[r] != row[r];
      for (int64_t r = 1; r < k; ++r) unsorted |= row[r] > row[r - 1];
    } else {
      for (int64_t r = 0; r < k; ++r) nan |= row[r * col_stride] != row[r * col_stride];
      for (int64_t r = 1; r < k; ++r) unsorted |= row[r * col_stride] > row[(r - 1) * col_stride];
    }
  }
  return nan ? kNaN : unsorted ? kUnsorted : 0;
}

template <typename F>
long build(int64_t root, const F* lp_in, int64_t lp_row, int64_t lp_col, const int64_t* tok,
           int64_t tok_row, int64_t tok_col, int64_t n_depth, int64_t k_all, int64_t budget,
           int64_t* out_tokens, int64_t* out_parents, int64_t* out_depth, double* out_scores,
           uint8_t* out_vis) {
  const long status = check_values(lp_in, n_depth, k_all, lp_row, lp_col);
  if (status != 0) return status;
  const int64_t k = std::min(k_all, budget);  // rank >= budget has `budget` better siblings
  const double inf = INFINITY;
  auto lp = [&](int64_t d, int64_t r) { return static_cast<double>(lp_in[d * lp_row + r * lp_col]); };

  BuildState state{n_depth, std::vector<int32_t>(static_cast<size_t>(budget + 1) * n_depth)};
  std::vector<Candidate> heap;
  heap.reserve(static_cast<size_t>(budget) + 2);
  auto later = [&state](const Candidate& a, const Candidate& b) { return state.after(a, b); };
  auto push = [&](const Candidate& c) {
    heap.push_back(c);
    std::push_heap(heap.begin(), heap.end(), later);
  };

  out_tokens[0] = root;
  out_parents[0] = -1;
  out_depth[0] = 0;
  out_scores[0] = 0.0;
  int64_t m = 1;
  if (budget > 0 && n_depth > 0 && k > 0 && lp(0, 0) > -inf) push({-lp(0, 0), 0, 1, 0});
  while (!heap.empty() && m <= budget) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    const int64_t node = m++;
    const int64_t d = c.depth;
    out_tokens[node] = tok[(d - 1) * tok_row + c.rank * tok_col];
    out_parents[node] = c.parent;
    out_depth[node] = d;
    out_scores[node] = -c.neg_score;
    int32_t* node_ranks = &state.ranks[static_cast<size_t>(node) * n_depth];
    std::memcpy(node_ranks, &state.ranks[static_cast<size_t>(c.parent) * n_depth],
                sizeof(int32_t) * (d - 1));
    node_ranks[d - 1] = c.rank;
    if (c.rank + 1 < k && lp(d - 1, c.rank + 1) > -inf) {
      push({-(out_scores[c.parent] + lp(d - 1, c.rank + 1)), c.parent, c.depth, c.rank + 1});
    }
    if (d < n_depth && lp(d, 0) > -inf) {
      push({c.neg_score - lp(d, 0), static_cast<int32_t>(node), c.depth + 1, 0});
    }
  }
  // visibility [m, m]: a node sees what its parent p sees, and itself. Parents come first, so
  // row p is zero past column p: copy its first p + 1 bytes onto a zeroed row.
  std::memset(out_vis, 0, static_cast<size_t>(m * m));
  out_vis[0] = 1;
  for (int64_t i = 1; i < m; ++i) {
    const int64_t p = out_parents[i];
    std::memcpy(out_vis + i * m, out_vis + p * m, static_cast<size_t>(p + 1));
    out_vis[i * m + i] = 1;
  }
  return static_cast<long>(m);
}

// build_tree(root, lp, lp_is_f64, lp_row, lp_col, tok, tok_row, tok_col, L, K, budget, cap,
//            out_ints, out_scores, out_vis) -> M, or kNaN / kUnsorted.
// lp [L, K] float32/float64 and tok [L, K] int64 by element strides; cap >= M (the wrapper
// bounds M by the budget and the number of rank tuples); out_ints [3, cap] int64 rows
// tokens/parents/depth; out_scores [cap] float64; out_vis >= M * M bytes, written as a
// contiguous [M, M] bool.
PyObject* py_build_tree(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[15];
  if (!parse_ints("build_tree", args, nargs, 15, a)) return nullptr;
  const int64_t cap = a[11];
  int64_t* ints = ptr<int64_t>(a[12]);
  long result;
  Py_BEGIN_ALLOW_THREADS;
  if (a[2]) {
    result = build(a[0], ptr<const double>(a[1]), a[3], a[4], ptr<const int64_t>(a[5]), a[6],
                   a[7], a[8], a[9], a[10], ints, ints + cap, ints + 2 * cap,
                   ptr<double>(a[13]), ptr<uint8_t>(a[14]));
  } else {
    result = build(a[0], ptr<const float>(a[1]), a[3], a[4], ptr<const int64_t>(a[5]), a[6],
                   a[7], a[8], a[9], a[10], ints, ints + cap, ints + 2 * cap,
                   ptr<double>(a[13]), ptr<uint8_t>(a[14]));
  }
  Py_END_ALLOW_THREADS;
  return PyLong_FromLong(result);
}

// ---------------------------------------------------------------------------------------------
// fill_layout: the additive verify mask [M, start + M] (row-major, contiguous) and positions.
// Row i: columns [0, start) visible (the committed prefix), [start, start + M) visible where
// visibility[i] is set, hidden otherwise. Visible is +0.0 (all bits zero in every float
// format), hidden is the bit pattern `hidden` (finfo(dtype).min). Positions: start + depth[i].

template <typename T>
void fill_rows(const uint8_t* vis, int64_t m, int64_t vis_row, int64_t start, T hidden,
               T* mask) {
  const int64_t cols = start + m;
  for (int64_t i = 0; i < m; ++i) {
    T* row = mask + i * cols;
    std::memset(row, 0, sizeof(T) * static_cast<size_t>(start));
    const uint8_t* v = vis + i * vis_row;
    T* tree = row + start;
    for (int64_t j = 0; j < m; ++j) tree[j] = v[j] ? T(0) : hidden;
  }
}

// fill_layout(vis, m, vis_row, depth, depth_stride, start, elem_bytes, hidden_bits, mask,
//             positions) -> None
// vis [M, M] bool with unit column stride; mask [M, start + M] and positions [M] contiguous.
PyObject* py_fill_layout(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[10];
  if (!parse_ints("fill_layout", args, nargs, 10, a)) return nullptr;
  const uint8_t* vis = ptr<const uint8_t>(a[0]);
  const int64_t m = a[1], vis_row = a[2], depth_s = a[4], start = a[5];
  const int64_t* depth = ptr<const int64_t>(a[3]);
  const long long elem = a[6];
  const uint64_t hidden = static_cast<uint64_t>(a[7]);
  if (elem != 2 && elem != 4 && elem != 8) {
    PyErr_Format(PyExc_ValueError, "fill_layout: element size %lld is not 2, 4 or 8", elem);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS;
  if (elem == 2) {
    fill_rows<uint16_t>(vis, m, vis_row, start, static_cast<uint16_t>(hidden), ptr<uint16_t>(a[8]));
  } else if (elem == 4) {
    fill_rows<uint32_t>(vis, m, vis_row, start, static_cast<uint32_t>(hidden), ptr<uint32_t>(a[8]));
  } else {
    fill_rows<uint64_t>(vis, m, vis_row, start, hidden, ptr<uint64_t>(a[8]));
  }
  int64_t* positions = ptr<int64_t>(a[9]);
  for (int64_t i = 0; i < m; ++i) positions[i] = start + depth[i * depth_s];
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------------------------
// accept_greedy: from the root, move to the child whose token is the target's token at the
// current node, while there is one. Nodes are parents-first and the accepted path increases
// in index, so one scan suffices: node j extends the path when its parent is the path's last
// node and its token matches (the first such j, as the reference walk takes the first match).

// accept_greedy(tokens, tok_stride, parents, par_stride, target, tgt_stride, m, out)
// -> (tau, bonus token), or (-1, 0) when a parent does not come before its child.
PyObject* py_accept_greedy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long long a[8];
  if (!parse_ints("accept_greedy", args, nargs, 8, a)) return nullptr;
  const int64_t* tokens = ptr<const int64_t>(a[0]);
  const int64_t* parents = ptr<const int64_t>(a[2]);
  const int64_t* target = ptr<const int64_t>(a[4]);
  const int64_t tok_s = a[1], par_s = a[3], tgt_s = a[5], m = a[6];
  int64_t* out = ptr<int64_t>(a[7]);
  long tau = 1;
  int64_t here = 0;
  Py_BEGIN_ALLOW_THREADS;
  out[0] = 0;
  for (int64_t j = 1; j < m; ++j) {
    const int64_t p = parents[j * par_s];
    if (p < 0 || p >= j) {
      tau = -1;
      break;
    }
    if (p == here && tokens[j * tok_s] == target[here * tgt_s]) {
      out[tau++] = j;
      here = j;
    }
  }
  Py_END_ALLOW_THREADS;
  const long long bonus = tau < 0 ? 0 : target[here * tgt_s];
  return Py_BuildValue("(lL)", tau, bonus);
}

PyMethodDef kMethods[] = {
    {"build_tree", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_build_tree)),
     METH_FASTCALL, "Best-first draft tree into preallocated buffers (see _native.cpp)."},
    {"fill_layout",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_fill_layout)), METH_FASTCALL,
     "Additive verify mask and positions into preallocated buffers (see _native.cpp)."},
    {"accept_greedy",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_accept_greedy)),
     METH_FASTCALL, "Greedy accept walk into a preallocated buffer (see _native.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_native", "Compiled DDTree tree core (raw-buffer kernels).", -1,
    kMethods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  if (PyModule_AddIntConstant(module, "ABI_VERSION", kAbiVersion) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
