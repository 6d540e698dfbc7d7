"""The results store (atomic appends, truncated lines, keys), the environment stamp, the timer."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from longca_triton.bench.store import (
    ResultStore,
    collect_env,
    params_digest,
    row_key,
    status_kind,
)
from longca_triton.bench.timing import peak_memory, time_fn


def _row(i=0, **kw):
    r = {"backend": "flex", "mask": "causal", "mask_params": {"seed": 0}, "seqlen": 4096, "batch": 1, "heads_q": 64,
         "heads_kv": 8, "head_dim": 128, "dtype": "bfloat16", "mode": "fwd", "status": "ok", "time_ms": 1.0 + i}
    r.update(kw)
    return r


def test_append_and_read_back(tmp_path):
    s = ResultStore(tmp_path / "sub" / "r.jsonl")
    assert s.rows() == [] and s.done_keys() == set()
    s.append(_row(0))
    s.append(_row(1, mode="bwd", nested={"a": [1, 2]}, value=float("nan")))
    rows = s.rows()
    assert [r["mode"] for r in rows] == ["fwd", "bwd"] and rows[1]["nested"] == {"a": [1, 2]}
    text = (tmp_path / "sub" / "r.jsonl").read_text()
    assert text.count("\n") == 2 and text.endswith("\n")


def test_truncated_last_line_is_ignored_and_repaired(tmp_path):
    p = tmp_path / "r.jsonl"
    s = ResultStore(p)
    s.append(_row(0))
    s.append(_row(1, mode="bwd"))
    # a writer killed mid-write leaves half a line
    with open(p, "ab") as f:
        f.write(json.dumps(_row(2, mode="fwd_bwd")).encode()[:37])
    rows = s.rows()
    assert len(rows) == 2 and s.skipped_lines == 1
    assert row_key(_row(2, mode="fwd_bwd")) not in s.done_keys()
    s.append(_row(3, mode="fwd_bwd"))  # must start on a fresh line
    rows = s.rows()
    assert [r["mode"] for r in rows] == ["fwd", "bwd", "fwd_bwd"] and rows[-1]["time_ms"] == 4.0
    assert s.skipped_lines == 1  # the garbled fragment stays, as its own (skipped) line


def test_garbled_middle_line_skipped(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps(_row(0)) + "\n{not json\n[1, 2]\n" + json.dumps(_row(1, mode="bwd")) + "\n")
    s = ResultStore(p)
    assert len(s.rows()) == 2 and s.skipped_lines == 2


def test_row_key_fields():
    a = _row(0)
    assert row_key(a) == row_key(_row(5, time_ms=99.0, status="oom"))  # measurements are not identity
    for field, value in (("backend", "sdpa-cudnn"), ("seqlen", 8192), ("heads_kv", 64), ("dtype", "float16"),
                         ("mode", "bwd"), ("head_dim", 64), ("batch", 2), ("mask", "full")):
        assert row_key(a) != row_key(_row(0, **{field: value})), field
    assert row_key(a) != row_key(_row(0, mask_params={"seed": 1}))
    # digest given explicitly == digest computed from the params
    assert row_key(dict(a, params_digest=params_digest(a["mask_params"]))) == row_key(a)
    # context-parallel fields join the key only when present
    cp = _row(0, world_size=8, scheme="ring_p2p", plan={"chunks": 4})
    assert row_key(cp) != row_key(a) and row_key(cp) != row_key(dict(cp, world_size=4))
    assert row_key(cp) != row_key(dict(cp, plan={"chunks": 2}))
    hash(row_key(cp))


def test_params_digest_canonical():
    import numpy as np

    assert params_digest({"a": 1, "b": [1, 2]}) == params_digest({"b": (1, 2), "a": 1.0})
    assert params_digest({"a": np.int64(3)}) == params_digest({"a": 3})
    assert params_digest({"a": 1}) != params_digest({"a": 2})
    assert len(params_digest(None)) == 12


def test_done_keys_by_status(tmp_path):
    s = ResultStore(tmp_path / "r.jsonl")
    s.append(_row(0, status="ok"))
    s.append(_row(0, mode="bwd", status="error: boom"))
    s.append(_row(0, seqlen=1024, status="unsupported: no"))
    assert len(s.done_keys()) == 3
    assert s.done_keys(statuses={"ok", "unsupported"}) == {row_key(_row(0)), row_key(_row(0, seqlen=1024))}
    assert status_kind("error: x: y") == "error" and status_kind({"status": "oom"}) == "oom"


def _writer(path, wid, n):
    s = ResultStore(path)
    for i in range(n):
        s.append(_row(i, backend=f"w{wid}", blob="x" * 5000))


def test_concurrent_appenders_never_interleave(tmp_path):
    p = tmp_path / "r.jsonl"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(p, w, 40)) for w in range(4)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(30)
        assert pr.exitcode == 0
    s = ResultStore(p)
    rows = s.rows()
    assert len(rows) == 160 and s.skipped_lines == 0
    assert {r["backend"] for r in rows} == {"w0", "w1", "w2", "w3"}


def test_collect_env(monkeypatch):
    monkeypatch.setenv("LONGCA_GIT_COMMIT", "abc123")
    env = collect_env(refresh=True)
    for k in ("hostname", "time", "torch", "triton", "cuda", "cudnn", "gpu", "driver", "vendors", "git_commit", "python", "device"):
        assert k in env, k
    assert env["git_commit"] == "abc123" and isinstance(env["vendors"], dict)
    json.dumps(env)
    monkeypatch.delenv("LONGCA_GIT_COMMIT")
    collect_env(refresh=True)


def test_time_fn_host():
    calls = []

    def fn():
        calls.append(1)
        sum(range(2000))

    t = time_fn(fn, warmup_ms=1, rep=7, device="cpu")
    assert t["reps"] == 7 and t["p20_ms"] <= t["median_ms"] <= t["p80_ms"] and t["min_ms"] > 0
    assert len(calls) >= 8  # one untimed call, warm-up, 7 timed
    t = time_fn(fn, warmup_ms=0, rep=50, device="cpu", max_ms=1e-9, min_rep=3)
    assert t["reps"] == 3
    with pytest.raises(ValueError):
        time_fn(fn, 0, 0, device="cpu")
    assert peak_memory(fn, device="cpu")["peak_bytes"] is None


@pytest.mark.gpu
def test_time_fn_cuda():  # pragma: no cover
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(4096, 4096, device="cuda")
    t = time_fn(lambda: x @ x, warmup_ms=5, rep=5)
    assert t["median_ms"] > 0


def test_rewrite_replaces_the_file(tmp_path):
    from longca_triton.bench.store import ResultStore

    store = ResultStore(tmp_path / "r.jsonl")
    store.extend([{"a": 1}, {"a": 2}])
    store.rewrite([r for r in store.rows() if r["a"] != 1] + [{"a": 3}])
    assert store.rows() == [{"a": 2}, {"a": 3}]
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"]  # no temporary left behind


# ---------------------------------------------------------------------------- gzipped results files
def _gzip(src, dst):
    import gzip

    dst.write_bytes(gzip.compress(src.read_bytes(), compresslevel=9, mtime=0))
    return dst


def test_gzipped_results_read_as_the_plain_file(tmp_path):
    from longca_triton.bench.store import read_lines

    plain = tmp_path / "results.jsonl"
    ResultStore(plain).extend([_row(i, mode=m) for i, m in enumerate(("fwd", "bwd", "fwd_bwd"))])
    with open(plain, "a") as f:
        f.write("{not json\n" + json.dumps(_row(9))[:20])  # a garbled line and a cut last line
    gz = _gzip(plain, tmp_path / "results.jsonl.gz")
    a, b = ResultStore(plain), ResultStore(gz)
    assert b.rows() == a.rows() and len(a.rows()) == 3 and b.skipped_lines == a.skipped_lines == 2
    assert b.done_keys() == a.done_keys() and len(b) == 3
    assert list(read_lines(gz)) == list(read_lines(plain))
    # written only plain: a bench never appends to (or rewrites) a .gz
    with pytest.raises(ValueError, match="gzipped"):
        b.append(_row(5))
    with pytest.raises(ValueError, match="gzipped"):
        b.rewrite(a.rows())
    assert ResultStore(tmp_path / "absent.jsonl.gz").rows() == []


def test_gzip_cut_short_keeps_the_rows_before_the_cut(tmp_path):
    plain = tmp_path / "r.jsonl"
    ResultStore(plain).extend([_row(i, blob="x" * 2000 + str(i)) for i in range(200)])  # incompressible enough
    gz = _gzip(plain, tmp_path / "r.jsonl.gz")
    data = gz.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])  # a copy killed mid-write
    s = ResultStore(cut)
    rows = s.rows()
    assert 0 < len(rows) < 200 and rows == ResultStore(plain).rows()[: len(rows)]
    assert s.skipped_lines <= 1  # the cut line, if the cut fell inside one
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_text(json.dumps(_row(0)) + "\n")  # named .gz, not gzip
    with pytest.raises(ValueError, match="bad.jsonl.gz: not a readable gzip file"):
        ResultStore(bad).rows()


def test_both_plain_and_gzip_in_one_folder_the_plain_wins_with_a_warning(tmp_path):
    from longca_triton.bench.store import BothResultsWarning, prefer_plain, results_in

    plain, gz = tmp_path / "results.jsonl", tmp_path / "results.jsonl.gz"
    with pytest.raises(FileNotFoundError, match="no results file"):
        results_in(tmp_path)
    ResultStore(plain).extend([_row(0)])
    assert results_in(tmp_path) == plain
    _gzip(plain, gz)
    plain.unlink()
    assert results_in(tmp_path) == gz  # only the .gz: it
    ResultStore(plain).extend([_row(0), _row(1, mode="bwd")])  # the plain one, newer (a bench appended to it)
    with pytest.warns(BothResultsWarning, match=r"results.jsonl.gz.*reading results.jsonl, not results.jsonl.gz"):
        assert results_in(tmp_path) == plain
    other = tmp_path / "sub" / "results.jsonl.gz"
    other.parent.mkdir()
    _gzip(plain, other)
    with pytest.warns(BothResultsWarning):
        assert prefer_plain([plain, gz, other]) == [plain, other]
    with pytest.warns(BothResultsWarning):
        assert prefer_plain([gz, other]) == [plain, other]  # the plain one next to it on disk, not listed
