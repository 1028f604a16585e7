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
        geo_type = FAMILIES[name].config().get_text_config(decoder=True).model_type
        assert cells["calibrate"].ok, (name, cells["calibrate"].note)
        assert cells["fold-weights"].ok == (geo_type in ARCHITECTURES), name
    # chunked attention (Llama 4): the cache reads each query's chunk through the torch path; gpt-oss:
    # sinks in the cache and the kernel, refused by every engine
    assert rows["llama4_text"]["cache"].ok and "chunked layers" in rows["llama4_text"]["decode kernel"].note
    assert rows["gpt_oss"]["cache"].ok and "sinks" in rows["gpt_oss"]["decode kernel"].note
    assert all(not rows["gpt_oss"][t].ok and "attention-sink" in rows["gpt_oss"][t].note
               for t in support.columns()[len(support.CORE):])
    rendered = support.render()
    assert all(f"| `{t}` | {why} |" in rendered for t, why in UNSUPPORTED.items())
