"""The ctr demo's configuration: its ids are long-tailed and a cap is a fraction of the distinct
ids trained on, reaching the table specs; ``kvps demo`` checks the fraction (no cluster here)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvps.cli.main import build_parser
from kvps.demo.ctr import CtrConfig, distinct_ids, make_data


def test_ids_are_long_tailed_and_caps_reach_the_table_specs():
    cfg = replace(CtrConfig(seed=3), train=20_000, test=1_000)
    data = make_data(cfg)
    users, items = distinct_ids(data)
    assert users < cfg.users and items < cfg.items  # a long tail: many ids never drawn
    counts = np.bincount(data[0], minlength=cfg.users)
    top = np.sort(counts)[::-1]
    assert top[:users // 2].sum() > 0.8 * counts.sum()  # the more popular half: most impressions
    assert "max_rows" not in cfg.table_spec("user")
    capped = replace(cfg, caps=(users // 2, items // 2), evict="lru")
    assert capped.table_spec("user")["max_rows"] == users // 2
    assert capped.table_spec("item")["max_rows"] == items // 2
    assert capped.table_spec("item")["evict"] == "lru"


@pytest.mark.parametrize("text, ok", [("0.5", True), ("1", True), ("0", False), ("1.5", False),
                                      ("nan", False), ("half", False)])
def test_demo_takes_a_fraction_in_zero_one(text, ok, capsys):
    parser = build_parser()
    if ok:
        args = parser.parse_args(["demo", "--task", "ctr", "--max-rows-fraction", text, "--evict", "lru"])
        assert args.max_rows_fraction == float(text) and args.evict == "lru"
    else:
        with pytest.raises(SystemExit):
            parser.parse_args(["demo", "--task", "ctr", "--max-rows-fraction", text])
        assert "fraction in (0, 1]" in capsys.readouterr().err


def test_no_faults_is_an_option_of_the_ctr_task_only():
    parser = build_parser()
    assert parser.parse_args(["demo", "--task", "ctr", "--no-faults"]).faults is False
    assert parser.parse_args(["demo", "--task", "ctr"]).faults is True
