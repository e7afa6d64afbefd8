"""benchmarks/bench_recipe.py's rank check: the final gap's noise ceiling (split-half rho and
its Spearman-Brown reliability) that the meter's Spearman rho is read against, computed right."""

import math

import pytest
from _bench import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("bench_recipe") as module:
        yield module


def test_halves_that_rank_the_recipes_alike_are_fully_reliable(bench):
    gaps = [[0.01 * i, 0.01 * i + 0.001, 0.01 * i, 0.01 * i - 0.001] for i in range(12)]
    assert bench._split_half(gaps) == (pytest.approx(1.0), pytest.approx(1.0))


def test_a_half_rho_is_stepped_up_by_spearman_brown(bench):
    # the halves' means: (0, 1, 2, 3) against (0, 2, 1, 3): rho 0.8 -> reliability 1.6 / 1.8
    gaps = [[0, 0], [1, 2], [2, 1], [3, 3]]
    rho, reliability = bench._split_half(gaps)
    assert rho == pytest.approx(0.8)
    assert reliability == pytest.approx(2 * 0.8 / 1.8)


def test_one_seed_or_reversed_halves_have_no_reliability(bench):
    assert all(math.isnan(v) for v in bench._split_half([[0.1], [0.2], [0.3]]))
    rho, reliability = bench._split_half([[0, 3], [1, 2], [2, 1], [3, 0]])
    assert rho == pytest.approx(-1.0) and math.isnan(reliability)


def test_an_odd_seed_count_drops_the_last_seed_from_the_halves(bench):
    # seed 3 would reverse the order; the halves are seeds (0) and (1) only
    gaps = [[0, 0, 9], [1, 1, -9], [2, 2, 0]]
    assert bench._split_half(gaps)[0] == pytest.approx(1.0)
