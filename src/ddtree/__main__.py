import os
import sys

from ddtree.cli import main

code = main()
if "torch.distributed" in sys.modules:  # only a command that used it pays for the import
    from ddtree.distributed import launched_by_torchrun

    if launched_by_torchrun():
        # A launched rank has closed its group and written everything by now; leave without
        # the interpreter's C++ teardown, where torch.distributed's store/gloo threads made a
        # rank abort ('terminate called without an active exception', exit -6) in CI.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
raise SystemExit(code)
