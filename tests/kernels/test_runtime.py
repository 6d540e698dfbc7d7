"""The kernels' shared host-side helpers (``kernels/core/runtime.py``)."""

import os
import subprocess
import sys
import textwrap


def test_importing_the_cli_modules_leaves_torch_dynamo_unimported_until_a_disabled_function_runs():
    """``compile_disabled`` defers ``torch.compiler.disable`` (which imports ``torch._dynamo``, seconds of
    imports) to the first call, so a command that never compiles starts without it."""
    code = textwrap.dedent("""
        import sys
        import longca_triton.bench.autotune, longca_triton.cli  # noqa: F401
        assert "torch._dynamo" not in sys.modules, "torch._dynamo imported at import time"
        from longca_triton.kernels.core.runtime import compile_disabled

        def twice(x):
            return 2 * x

        f = compile_disabled(twice)
        assert f.__name__ == "twice" and f(21) == 42
        assert "torch._dynamo" in sys.modules  # the first call applied torch.compiler.disable
        import torch
        g = compile_disabled(twice)  # torch._dynamo already there: applied at once
        assert g is not twice and g(1) == 2
        assert torch.compile(lambda x: f(x) + 1, backend="eager")(torch.ones(2)).tolist() == [3.0, 3.0]
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
