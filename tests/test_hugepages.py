"""Weights and KV cache on transparent huge pages (sluice/hugepages.py): the arena's views are
zeroed, aligned, disjoint and backed by huge pages (read from /proc/self/smaps); moving a module
keeps its values and its tied parameters; an engine on huge pages decodes exactly as one without."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from sluice import hugepages
from sluice.llm import LLM
from sluice.sampling_params import SamplingParams

try:
    from sluice.model.default import ensure_default_model
    MODEL = ensure_default_model()
except Exception:  # noqa: BLE001 -- as in test_model_smollm2.py: the engine test needs the file
    MODEL = Path("/root/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf")

needs_thp = pytest.mark.skipif(not hugepages.available(),
                               reason="no transparent huge pages for advised mappings here")


def huge_kb_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_zeros_gives_disjoint_aligned_zeroed_views():
    shapes = [((3, 5, 7), torch.bfloat16), ((1000, 16, 3, 64), torch.float32), ((9,), torch.int64)]
    for huge in (True, False):
        ts = hugepages.zeros(shapes, huge)
        assert [(tuple(t.shape), t.dtype) for t in ts] == shapes
        assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 and not t.any() for t in ts)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        for i, t in enumerate(ts):
            t.fill_(i + 1)
        assert [t.unique().tolist() for t in ts] == [[1], [2], [3]]


@needs_thp
def test_arena_is_backed_by_huge_pages():
    (cache,) = hugepages.zeros([((2048, 16, 3, 64), torch.bfloat16)], True)  # 12 MiB, zeroed: touched
    assert cache.data_ptr() % hugepages.HUGE_PAGE == 0
    assert huge_kb_at(cache.data_ptr()) >= 4 * 2048
    (plain,) = hugepages.zeros([((2048, 16, 3, 64), torch.bfloat16)], False)
    assert plain.shape == cache.shape  # ordinary pages asked for: torch's allocator, not an arena
    assert plain.data_ptr() % hugepages.HUGE_PAGE != 0 or huge_kb_at(plain.data_ptr()) == 0


@needs_thp
def test_arena_refuses_to_overflow():
    arena = hugepages.HugePageArena(100)
    arena.take((hugepages.HUGE_PAGE // 4,), torch.float32)
    with pytest.raises(ValueError, match="bytes left"):
        arena.take((1,), torch.float32)


@needs_thp
def test_move_module_keeps_values_and_ties():
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 256)
    head = nn.Linear(256, 1000, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's LM head is
    model = nn.ModuleDict({"emb": emb, "head": head, "small": nn.Linear(4, 4)})
    model.register_buffer("table", torch.randn(512, 512))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small_ptr = model["small"].weight.data_ptr()
    x = torch.randint(0, 1000, (7,))
    y0 = model["head"](model["emb"](x))

    moved = hugepages.move_module(model)

    assert moved >= (1000 * 256 + 512 * 512) * 4
    assert model["head"].weight is model["emb"].weight and isinstance(model["emb"].weight, nn.Parameter)
    assert model["small"].weight.data_ptr() == small_ptr  # under the size floor: left alone
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert torch.equal(model["head"](model["emb"](x)), y0)
    for t in (model["emb"].weight, model.table):
        assert huge_kb_at(t.data_ptr()) > 0


@needs_thp
@pytest.mark.skipif(not Path(MODEL).is_file(), reason=f"{MODEL} is not available")
def test_engine_on_huge_pages_decodes_as_without():
    """The default model on the compiled CPU path (packed weights, decoder stack): its KV cache and
    packed weights lie on huge pages, and greedy tokens equal an engine's on ordinary pages."""
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(200, 440))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for huge in (True, False):
        llm = LLM(str(MODEL), max_model_len=512, kv_cache_tokens=4096, huge_pages=huge)
        k_cache = llm.engine.runner.kv_caches[0][0]
        packed = llm.engine.runner.model.layers[0].mlp.gate_up_proj.packed
        if huge:
            assert huge_kb_at(k_cache.data_ptr()) > 0 and huge_kb_at(packed.data_ptr()) > 0
            stack = llm.engine.runner.model.compiled_stack
            assert stack is None or stack.gate_up[0].data_ptr() == packed.data_ptr()
        outs[huge] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.scheduler.check_invariants()
        del llm
    assert outs[True] == outs[False]


_RSS_SCRIPT = """
import sys
from sluice.llm import LLM
llm = LLM(sys.argv[1], max_model_len=512, kv_cache_tokens=4096, huge_pages=sys.argv[2] == "1")
rss = [l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]
print(int(rss) * 1024)
"""


@needs_thp
@pytest.mark.skipif(not Path(MODEL).is_file(), reason=f"{MODEL} is not available")
def test_moving_the_weights_leaves_no_second_copy_resident():
    """The weights' old copies are freed and the heap handed back: a process on huge pages is
    no larger than one without (glibc keeps freed chunks resident unless trimmed: +370 MB)."""
    import subprocess
    import sys

    rss = {}
    for huge in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(MODEL), huge], capture_output=True,
                             text=True, timeout=300, check=True)
        rss[huge] = int(out.stdout.split()[-1])
    assert rss["1"] <= rss["0"] + (64 << 20), {k: v >> 20 for k, v in rss.items()}
