"""``doctor``: the GPU, the versions, and each backend's availability (with the reason when not)."""

from __future__ import annotations

import time

from longca_triton.adapters import list_backends

from .store import collect_env

__all__ = ["backend_status", "doctor_info"]


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
