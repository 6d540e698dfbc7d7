"""``doctor``: the GPU, the versions, and each backend's availability (with the reason when not)."""

from __future__ import annotations

import time

from longca_triton.adapters import list_backends

from .store import collect_env

__all__ = ["ENV_KEYS", "backend_status", "doctor_info", "env_rows"]


def backend_status() -> list[dict]:
    out = []
    for b in list_backends():
        t = time.perf_counter()
        try:
            ok, why = b.available()
        except Exception as e:  # an adapter's probe must never break doctor
            ok, why = False, f"availability probe raised {type(e).__name__}: {e}"
        out.append({
            "name": b.name,
            "available": bool(ok),
            "reason": why,
            "description": b.description,
            "modes": list(b.modes),
            "returns_lse": bool(b.returns_lse),
            "lowering": getattr(b, "lowering", ""),
            "probe_s": round(time.perf_counter() - t, 3),
        })
    return out


def doctor_info() -> dict:
    return {"env": collect_env(), "backends": backend_status()}


#: the environment fields of doctor's table, in order
ENV_KEYS = ("gpu", "gpu_capability", "gpu_memory_gib", "driver", "cuda", "torch", "triton", "cudnn", "python",
            "git_commit", "hostname")


def env_rows(env: dict) -> list[dict]:
    """The environment as doctor's table shows it: every field a value, or ``none`` / ``unknown``
    and why (a CPU machine's GPU fields say that there is no GPU, and why torch sees none)."""
    cpu_build = env.get("cuda") is None
    no_gpu = ("none (this torch is a CPU build)" if cpu_build else
              f"none (torch built for CUDA {env.get('cuda')} sees no GPU: no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them)")
    why = {
        "gpu": no_gpu,
        "gpu_capability": "none (no GPU)",
        "gpu_memory_gib": "none (no GPU)",
        "driver": "unknown (neither nvidia-ml-py nor nvidia-smi answered)" if env.get("gpu") else "none (no GPU)",
        "cuda": "none (this torch is a CPU build)",
        "cudnn": "none (this torch has no cuDNN)",
        "triton": "none (not installed)",
        "git_commit": "unknown (not run from a git checkout)",
    }
    rows = [{"what": k, "value": env.get(k) if env.get(k) is not None else why.get(k, "unknown")} for k in ENV_KEYS]
    rows.append({"what": "vendors", "value": ", ".join(f"{k} {v}" for k, v in sorted(env.get("vendors", {}).items()))
                 or "none"})
    rows.append({"what": "interpreted", "value": bool(env.get("interpreted"))})
    return rows
