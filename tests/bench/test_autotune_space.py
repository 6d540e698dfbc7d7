"""What autotune searches and compiles ahead, on the CPU: the shipped default and its neighbours
(not the cross product), every kernel a search will build handed to the compile pool in the order
the search needs it, and the pool's launches turned into compile requests and back."""

import pytest
import torch

from longca_triton.bench import autotune_run as run
from longca_triton.bench.autotune import TUNABLES
from longca_triton.bench.compile_ahead import CompileAhead, _compile_only_worker, _portable
from longca_triton.masks import make_mask


def _dist(a, b):
    return sum(a[k] != b.get(k) for k in a)


def _case(name, S=4096, D=128):
    return run.TuneCase(make_mask(name, S), 64, 8, D, torch.bfloat16, label=f"{name} S={S}")


# the dense kernel's default on a GPU row (the CPU's own row would centre the search elsewhere)
GPU_DENSE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, DKDV_BLOCK_M=64, DKDV_BLOCK_N=64,
                 dkdv_num_warps=4, dkdv_num_stages=2, DQ_BLOCK_M=128, DQ_BLOCK_N=64, dq_num_stages=3, dkdv_sweep=2)


@pytest.mark.parametrize("kernel,group", [("triton", "fwd"), ("triton", "dkdv"), ("triton", "dq"),
                                          ("triton-gluon", "fwd"), ("triton-gluon", "bwd")])
def test_the_search_is_the_default_and_its_neighbours(kernel, group):
    t = TUNABLES[kernel]
    default = GPU_DENSE if kernel == "triton" else run.class_default(t, [_case("causal")])
    full = run.search_space(t, group, 64, 128)
    near = run.search_space(t, group, 64, 128, default=default)
    assert run.search_space(t, group, 64, 128, default=default, exhaustive=True) == full
    assert near and all(c in full for c in near)
    centre = min(full, key=lambda c: _dist(c, default))
    assert centre in near
    assert all(_dist(c, centre) <= 2 for c in near if c not in run._shipped_choices(t, tuple(centre)))
    # every candidate one knob away from the centre is searched
    assert all(c in near for c in full if _dist(c, centre) <= 1)
    if kernel == "triton-gluon" and group == "fwd":
        assert len(near) <= 20 < len(full)  # 82 candidates at D = 128 in the cross product


def test_the_shipped_tables_choices_join_the_search():
    """A choice one of the shipped rows makes for a group's keys, applied to the centre, is searched
    even where it lies more than two knobs away."""
    t = TUNABLES["triton-gluon"]
    default = run.class_default(t, [_case("causal")])
    full = run.search_space(t, "fwd", 64, 128)
    centre = min(full, key=lambda c: _dist(c, default))
    shipped = [dict(centre, **ch) for ch in run._shipped_choices(t, tuple(centre))]
    near = run.search_space(t, "fwd", 64, 128, default=default)
    assert shipped and all(c in near for c in shipped if c in full)


class _Recorder:
    workers = 4

    def __init__(self):
        self.keys, self.configs = [], []

    def submit(self, key, tunable, case, config, mode, device):
        self.keys.append(key)
        self.configs.append((dict(config), mode))

    def wait(self, key):
        self.keys.append(("waited", *key))


def test_every_kernel_the_search_builds_is_submitted_in_order(autotune_cache):
    calls = []

    def attend(q, k, v, mask, config):
        calls.append(dict(config))
        return (q + k.sum() + v.sum()) * (1.0 + config["X"])

    t = run.Tunable(name="fake", groups={"fwd": "fwd", "dq": "bwd"},
                    candidates=lambda group, block, head_dim: [dict(X=i) for i in range(6)],
                    run=attend, default=lambda head_dim, dtype, mask=None, group=1: dict(X=0))
    cs = [run.TuneCase(make_mask(m, 64), 2, 1, 16, torch.float32, label=f"{m} S=64") for m in ("causal", "full")]
    ahead = _Recorder()
    n = run.submit_compiles(ahead, t, cs, 64, "cpu")
    # per class: the default forward, then backward, then each group's 6 candidates over the default
    assert n == len(ahead.keys) == 2 * (2 + 6 + 6)
    assert [k[2] for k in ahead.keys[:2]] == ["default", "default"] and ahead.configs[1] == (dict(X=0), "bwd")
    submitted = list(ahead.keys)
    # the search waits for each candidate's compile before timing it, under the same key
    run.tune(t, cs, 64, device="cpu", ahead=ahead)
    waited = {k[1:] for k in ahead.keys if k[0] == "waited"}
    assert waited == set(submitted)
    ahead = _Recorder()  # classes now in the cache are not compiled again
    assert run.submit_compiles(ahead, t, cs, 64, "cpu") == 0 and not ahead.keys
    assert run.submit_compiles(ahead, t, cs, 64, "cpu", force=True) == 28

    # a class of two cases: every candidate on the screening case first, then on the other one
    two = [run.TuneCase(make_mask("sliding_window_causal", 256, window=w), 2, 1, 16, torch.float32,
                        label=f"window {w}") for w in (16, 64)]
    ahead = _Recorder()
    assert run.submit_compiles(ahead, t, two, 64, "cpu") == 2 * 2 + 12 * 2
    cands = [k for k in ahead.keys if k[2] != "default"]
    assert [k[-1] for k in cands] == ["window 64"] * 12 + ["window 16"] * 12
    run.tune(t, two, 64, device="cpu", ahead=ahead)
    waited = {k[1:] for k in ahead.keys if k[0] == "waited"}
    assert {k[-1] for k in waited} == {"window 16", "window 64"} and waited <= set(cands) | {
        k for k in ahead.keys if k[2] == "default"}


def test_a_worker_compiles_without_launching(monkeypatch):
    from triton.runtime.jit import JITFunction

    seen = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: seen.append(warmup))
    _compile_only_worker()
    JITFunction.run(None, grid=(1,), warmup=False)
    assert seen == [True]


def test_what_travels_to_a_worker_leaves_the_inputs_and_memo_behind():
    case = _case("causal", S=256)
    case.inputs("cpu")
    case.mask.__dict__["_call_memo"] = {"k": object()}
    sent = _portable(case)
    assert sent._inputs is None and "_call_memo" not in sent.mask.__dict__
    assert sent.mask.slices == case.mask.slices and case._inputs is not None and "_call_memo" in case.mask.__dict__


def test_compile_ahead_without_workers_does_nothing():
    with CompileAhead(0) as ahead:
        ahead.submit(("k",), "triton", _case("causal", S=256), {}, "fwd")
        ahead.wait(("k",))
        assert ahead.submitted == 0 and not ahead.failed


def test_a_worker_process_runs_a_real_candidate_and_reports_failures():
    """Cases, configs and the registry's kernels travel to a spawned worker; a candidate its launcher
    refuses comes back as the error, the search's to meet when it times it."""
    case = run.TuneCase(make_mask("causal", 64), 2, 1, 16, torch.float16, label="causal S=64")
    case.inputs("cpu")  # the inputs stay behind
    with CompileAhead(1) as ahead:
        ahead.submit(("ok",), "triton", case, {}, "fwd", "cpu")
        ahead.submit(("bad",), "triton", case, {"BLOCK_M": 48}, "fwd", "cpu")
        ahead.wait(("ok",))
        ahead.wait(("bad",))
    assert ahead.submitted == 2
    assert len(ahead.failed) == 1 and ahead.failed[0].startswith("('bad',): ") and "BLOCK_M" in ahead.failed[0]
