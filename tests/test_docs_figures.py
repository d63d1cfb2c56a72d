"""The benchmark figures the README and docs quote are the ones bench/results.json holds
(bench/doc_figures.py writes them between markers): a copy cannot drift from BENCHMARKS.md."""
from __future__ import annotations

import json

import pytest

from bench import doc_figures
from tests.test_docs_links import ROOT

RESULTS = json.loads((ROOT / "bench" / "results.json").read_text())


@pytest.mark.parametrize("page", doc_figures.PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_figure_the_page_quotes_is_the_one_the_results_hold(page):
    text = page.read_text()
    assert text == doc_figures.rewritten(text, RESULTS), (
        f"{page.relative_to(ROOT)}: a figure differs from bench/results.json: run python bench/doc_figures.py")


def test_the_readme_quotes_the_headline_figures_from_the_results():
    names = {name for name, _ in doc_figures.marked((ROOT / "README.md").read_text())}
    assert names == {"quality_vs_dp", "user_loop_quality", "sick_learner", "missed_targets"}
    assert {name for page in doc_figures.PAGES for name, _ in doc_figures.marked(page.read_text())} == set(
        doc_figures.FIGURES)  # every figure is quoted somewhere


def test_a_marked_span_is_rewritten_and_the_text_around_it_kept():
    text = "before <!-- bench:sick_learner -->stale<!-- /bench --> after"
    assert doc_figures.rewritten(text, RESULTS) == (
        f"before <!-- bench:sick_learner -->{doc_figures.sick_learner(RESULTS)}<!-- /bench --> after")
