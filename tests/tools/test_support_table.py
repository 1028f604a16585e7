"""The support table of docs/reference/models.md is what the code says (``oscar_calib.tools.support``),
so it cannot drift; its cells follow the rules they state (a refused family's row, the registry's
entries, the export targets' refusals). tests/model/test_families.py checks each family's cells against
the real pipeline."""

from __future__ import annotations

from factories import REPO

from oscar_calib.model.families import FAMILIES
from oscar_calib.model.registry import ARCHITECTURES, UNSUPPORTED
from oscar_calib.tools import support

PAGE = REPO / "docs" / "reference" / "models.md"


def test_the_page_holds_the_generated_table():
    page = PAGE.read_text()
    assert support.page_block(page) == support.render(), \
        "docs/reference/models.md is stale: run python scripts/dev/support_table.py"


def test_cells_follow_the_registry_and_the_layer_kinds():
    rows = dict((fam.name, cells) for fam, cells in support.table())
    assert set(rows) == set(FAMILIES)
    for name, cells in rows.items():
        text = FAMILIES[name].config().get_text_config(decoder=True)
        spec = ARCHITECTURES.get(text.model_type)
        folds = spec is not None and not spec.fold_refusal and not getattr(text, spec.values_from_keys or "-", False)
        assert cells["calibrate"].ok, (name, cells["calibrate"].note)
        assert cells["fold-weights"].ok == folds, name
    # hybrids: the attention layers only, mapped by id; engines that number layers globally serve them, the fork's
    # main and upstream SGLang's pull request do not; Gemma 4: per-layer head sizes, served by the fork's newer
    # loader and mlx-lm only
    for name in ("qwen3_next", "qwen3_5_text", "lfm2"):
        assert "layer_ids" in rows[name]["calibrate"].note and "recurrent" in rows[name]["cache"].note
        assert [t for t in support.columns()[len(support.CORE):] if rows[name][t].ok] == \
            ["sglang-fork-v2", "vllm", "onnxruntime"], name
    assert "recurrent" in rows["falcon_h1"]["cache"].note and not rows["falcon_h1"]["sglang-fork"].ok
    for name in ("gemma4_text", "gemma4", "gemma4_unified"):
        assert "layer_head_dims" in rows[name]["calibrate"].note and "512" in rows[name]["decode kernel"].note
        assert [t for t in support.columns()[len(support.CORE):] if rows[name][t].ok] == \
            ["sglang-fork-v2", "mlx-lm"], name
    assert not rows["qwen3_next"]["fold-weights"].ok and "gate" in rows["qwen3_next"]["fold-weights"].note
    assert rows["gemma4_text"]["fold-weights"].ok and not rows["gemma4"]["fold-weights"].ok
    # chunked attention (Llama 4): the cache reads each query's chunk through the torch path; gpt-oss:
    # sinks in the cache and the kernel, refused by every engine
    assert rows["llama4_text"]["cache"].ok and "chunked layers" in rows["llama4_text"]["decode kernel"].note
    assert rows["gpt_oss"]["cache"].ok and "sinks" in rows["gpt_oss"]["decode kernel"].note
    assert all(not rows["gpt_oss"][t].ok and "attention-sink" in rows["gpt_oss"][t].note
               for t in support.columns()[len(support.CORE):])
    rendered = support.render()
    assert all(f"| `{t}` | {why} |" in rendered for t, why in UNSUPPORTED.items())
