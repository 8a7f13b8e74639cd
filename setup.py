"""Build of the compiled tree core (``ddtree.tree._native``); everything else is in
pyproject.toml. The extension is plain C++17 against the CPython C API (no numpy, torch or
pybind11 headers), so the build needs only setuptools and a C++ compiler and takes a few
seconds. It is optional: without a compiler the install succeeds and ``ddtree.tree`` uses the
Python builder (with a one-line notice)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FLAGS = {"msvc": ["/O2", "/std:c++17"]}
UNIX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden"]


class BuildExt(build_ext):
    def build_extensions(self):
        for ext in self.extensions:
            ext.extra_compile_args = FLAGS.get(self.compiler.compiler_type, UNIX_FLAGS)
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "ddtree.tree._native",
            sources=["src/ddtree/tree/_native.cpp"],
            language="c++",
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
