"""``attn_implementation="longca_triton"`` in real transformers models against ``"sdpa"``: logits and
gradients of a tiny Llama (causal, padded, packed), a 20-step training loop, a sliding-window
Mistral, transformers' own masks against our row intervals, the SDPA fallbacks and torch.compile."""

import copy
import logging
import sys

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch.utils._python_dispatch import TorchDispatchMode
from utils import DEVICE, needs_triton

transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask  # noqa: E402

from longca_triton.integrations import transformers as lt_transformers  # noqa: E402

pytestmark = needs_triton
LOGGER = "longca_triton.integrations.transformers"
#: float32 in the interpreter: normalised max error of logits and gradients
TOL = 2e-4
#: largest difference of the training loss at any of the 20 steps
LOSS_TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def registered():
    return lt_transformers.register()


class OpsSeen(TorchDispatchMode):
    """Records the name of every operator dispatched inside the ``with`` block."""

    def __enter__(self):
        self.names = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


OUR_OP = "longca_triton::attention"


def tiny_llama(**overrides):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, use_cache=False, **overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(DEVICE)


def pair(model):
    """(ours, sdpa): the same weights under both attention implementations."""
    ours = copy.deepcopy(model)
    ours.set_attn_implementation("longca_triton")
    model.set_attn_implementation("sdpa")
    return ours, model


def rel_err(a, b):
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def run(model, ids, **kw):
    model.zero_grad()
    out = model(ids, **kw)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def batch(case):
    g = torch.Generator().manual_seed(1)
    if case == "causal":
        ids = torch.randint(0, 128, (2, 40), generator=g)
        return ids, {}, torch.ones(2, 40, dtype=torch.bool)
    if case == "padded":  # one row left-padded, one right-padded
        ids = torch.randint(0, 128, (2, 40), generator=g)
        mask = torch.ones(2, 40, dtype=torch.long)
        mask[0, :11], mask[1, 33:] = 0, 0
        return ids, {"attention_mask": mask.to(DEVICE)}, mask.bool()
    ids = torch.randint(0, 128, (1, 56), generator=g)  # three packed documents of 17, 30 and 9 tokens
    pos = torch.cat([torch.arange(17), torch.arange(30), torch.arange(9)])[None]
    kw = {"position_ids": pos.to(DEVICE)}
    if case == "packed-cu-seqlens":  # the collator's cumulative lengths (SDPA reads the positions)
        cu = torch.tensor([0, 17, 47, 56], dtype=torch.int32, device=DEVICE)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30)
    return ids, kw, torch.ones(1, 56, dtype=torch.bool)


@pytest.mark.parametrize("case", ["causal", "padded", "packed", "packed-cu-seqlens"])
def test_logits_and_grads_match_sdpa(case):
    ours, sdpa = pair(tiny_llama())
    ids, kw, valid = batch(case)
    ids = ids.to(DEVICE)
    labels = ids.masked_fill(~valid.to(DEVICE), -100)
    with OpsSeen() as seen:
        logits, grads = run(ours, ids, labels=labels, **kw)
    assert OUR_OP in seen.names
    ref_logits, ref_grads = run(sdpa, ids, labels=labels, **kw)
    assert rel_err(logits[valid], ref_logits[valid]) < TOL
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < TOL, name
    if case.startswith("packed"):  # the documents change the result: the packing is not a no-op
        plain, _ = run(sdpa, ids, labels=labels)
        assert rel_err(plain, ref_logits) > 1e-3


def test_training_loss_curve_matches_sdpa():
    ours, sdpa = pair(tiny_llama())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (1, 16), generator=g).to(DEVICE)  # one random batch, learnt by heart
    pos = torch.cat([torch.arange(9), torch.arange(7)])[None].to(DEVICE)  # two packed documents
    curves = []
    for model in (ours, sdpa):
        torch.manual_seed(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            loss = model(ids, labels=ids, position_ids=pos).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(torch.tensor(losses))
    assert curves[1][-1] < curves[1][0] / 2  # the loop learns
    assert (curves[0] - curves[1]).abs().max().item() < LOSS_TOL


def test_sliding_window_mistral_routes_through_the_window_mask():
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, sliding_window=8, use_cache=False)
    torch.manual_seed(0)
    ours, sdpa = pair(MistralForCausalLM(cfg).to(DEVICE))
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with OpsSeen() as seen:
        logits = ours(ids).logits
    assert OUR_OP in seen.names
    assert rel_err(logits, sdpa(ids).logits) < TOL
    sdpa.config.sliding_window = None
    assert rel_err(logits, sdpa(ids).logits) > 1e-3  # the window matters at 40 tokens


def dense_of(rows, batch, seqlen):
    local = rows.view(batch, seqlen, 2) - (torch.arange(batch) * seqlen)[:, None, None]
    j = torch.arange(seqlen)
    return (j >= local[..., :1]) & (j <= local[..., 1:])


@pytest.mark.parametrize("case", ["padded", "packed", "padded-window", "packed-window"])
def test_row_intervals_match_transformers_masks(case):
    B, S, W = 3, 24, 5
    cfg = LlamaConfig(hidden_size=8, num_attention_heads=1, sliding_window=W if "window" in case else None)
    cfg._attn_implementation = "sdpa"
    embeds = torch.zeros(B, S, 8)
    padding = position_ids = None
    if "padded" in case:
        padding = torch.ones(B, S, dtype=torch.bool)
        padding[0, :7], padding[1, 20:], padding[2, :] = False, False, True
    else:
        position_ids = torch.stack([torch.cat([torch.arange(n), torch.arange(S - n)]) for n in (3, 12, 23)])
    make = create_sliding_window_causal_mask if "window" in case else create_causal_mask
    expected = make(cfg, embeds, padding, None, position_ids=position_ids, allow_is_causal_skip=False)[:, 0]
    rows = lt_transformers.row_intervals(B, S, S, window=W if "window" in case else None, padding=padding,
                                         position_ids=position_ids)
    got = dense_of(rows, B, S)
    live = padding if padding is not None else torch.ones(B, S, dtype=torch.bool)
    assert torch.equal(got[live], expected[live])


def test_cu_seqlens_and_position_ids_give_one_mask():
    S = 30
    position_ids = torch.cat([torch.arange(4), torch.arange(19), torch.arange(7)])[None]
    cu_seqlens = torch.tensor([0, 4, 23, 30], dtype=torch.int32)
    from_positions = lt_transformers.row_intervals(1, S, S, position_ids=position_ids)
    assert torch.equal(lt_transformers.row_intervals(1, S, S, cu_seqlens=cu_seqlens), from_positions)
    assert from_positions[4].tolist() == [4, 4] and from_positions[22].tolist() == [4, 22]


@pytest.mark.parametrize("what, reason", [
    ("dropout", "attention dropout"),
    ("gaps", "a padding mask with gaps inside a sequence"),
    ("float64", "dtype torch.float64"),
], ids=["dropout", "padding-gaps", "float64"])
def test_falls_back_to_sdpa_with_the_reason_logged(what, reason, caplog):
    model = tiny_llama(attention_dropout=0.5 if what == "dropout" else 0.0)
    if what == "float64":
        model = model.double()
    ours, sdpa = pair(model)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    kw = {}
    if what == "gaps":
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, 10:13] = 0
        kw["attention_mask"] = mask.to(DEVICE)
    if what == "dropout":
        ours.train()
    lt_transformers._LOGGED.clear()  # each reason is logged once per process
    with caplog.at_level(logging.WARNING, logger=LOGGER), OpsSeen() as seen:
        logits = ours(ids, **kw).logits
    assert OUR_OP not in seen.names
    assert any(reason in r.getMessage() for r in caplog.records)
    if what != "dropout":
        keep = torch.ones(2, 24, dtype=torch.bool) if what == "float64" else mask.bool()
        assert rel_err(logits[keep], sdpa(ids, **kw).logits[keep]) < TOL


@pytest.mark.parametrize("kind", ["bool", "float-bias"])
def test_a_prepared_4d_mask(kind, caplog):
    ours, sdpa = pair(tiny_llama())
    B, S = 2, 24
    cfg = copy.copy(sdpa.config)
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[0, :5] = False
    mask = create_causal_mask(cfg, torch.zeros(B, S, 64), padding, None, allow_is_causal_skip=False).to(DEVICE)
    if kind == "float-bias":  # a bias of other values than 0 and -inf: SDPA's to run
        mask = torch.where(mask, torch.linspace(-1, 0, S, device=DEVICE), float("-inf"))
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    lt_transformers._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER), OpsSeen() as seen:
        logits = ours(ids, attention_mask=mask).logits
    assert (OUR_OP in seen.names) == (kind == "bool")
    assert any("a float attention bias" in r.getMessage() for r in caplog.records) == (kind == "float-bias")
    assert rel_err(logits[padding], sdpa(ids, attention_mask=mask).logits[padding]) < TOL


def compile_inputs(case, cut):
    """(kwargs, valid tokens) of a batch of 2 x 32 tokens: two packed documents split at ``cut``, or a
    left- and a right-padded row with ``cut`` padding tokens each."""
    if case == "packed":
        pos = torch.cat([torch.arange(cut), torch.arange(32 - cut)])[None].expand(2, -1)
        return {"position_ids": pos.to(DEVICE)}, torch.ones(2, 32, dtype=torch.bool)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, :cut], mask[1, 32 - cut:] = 0, 0
    return {"attention_mask": mask.to(DEVICE)}, mask.bool()


@pytest.mark.parametrize("case", ["packed", "padded"])
def test_compiled_llama_is_one_graph_as_the_mask_changes(case):
    ours, sdpa = pair(tiny_llama())
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(ours, backend=counting, fullgraph=True)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    for cut in (10, 21):
        kw, valid = compile_inputs(case, cut)
        logits = compiled(ids, **kw).logits
        assert rel_err(logits[valid], sdpa(ids, **kw).logits[valid]) < TOL
    assert len(graphs) == 1


def test_register_without_transformers_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it now fails, as where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'longca-triton\[transformers\]'"):
        lt_transformers.register()


def test_register_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of default, triton, triton-gluon, reference, got 'fa3'"):
        lt_transformers.register(backend="fa3")


@pytest.mark.gpu
def test_bf16_llama_at_2k_matches_sdpa_on_the_gpu():
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=1024, use_cache=False)
    torch.manual_seed(0)
    ours, sdpa = pair(LlamaForCausalLM(cfg).to("cuda", torch.bfloat16))
    ids = torch.randint(0, 1024, (2, 2048), device="cuda")
    pos = torch.cat([torch.arange(700), torch.arange(1348)])[None].expand(2, -1).cuda()
    with OpsSeen() as seen:
        logits, grads = run(ours, ids, labels=ids, position_ids=pos)
    assert OUR_OP in seen.names
    ref_logits, ref_grads = run(sdpa, ids, labels=ids, position_ids=pos)
    assert rel_err(logits.float(), ref_logits.float()) < 3e-2
    for name, g in grads.items():
        assert rel_err(g.float(), ref_grads[name].float()) < 5e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_with_a_cache_matches_sdpa_on_the_gpu(cache):
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    ours, sdpa = pair(LlamaForCausalLM(cfg).to("cuda", torch.float16))
    ids = torch.randint(1, 256, (2, 300), device="cuda")
    padding = torch.ones_like(ids)
    padding[0, :37] = 0
    out = ours.generate(ids, attention_mask=padding, max_new_tokens=8, do_sample=False, output_logits=True,
                        return_dict_in_generate=True, cache_implementation="static" if cache == "static" else None)
    # every decoding step's logits against SDPA over the whole generated sequence, without a cache
    full_mask = torch.cat([padding, torch.ones(2, 8, dtype=padding.dtype, device="cuda")], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    ref = sdpa(out.sequences, attention_mask=full_mask, position_ids=pos).logits[:, 299:-1]
    assert rel_err(torch.stack(out.logits, 1).float(), ref.float()) < 2e-2
