"""The isolation rule of the shared fixtures (tests/conftest.py): a test marked isolated may not use one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import SHARED_FIXTURES, check_isolation

pytestmark = pytest.mark.unit


def fake_item(fixtures: list[str], isolated: bool) -> SimpleNamespace:
    return SimpleNamespace(fixturenames=fixtures, nodeid="tests/x.py::test_y",
                           get_closest_marker=lambda name: object() if isolated and name == "isolated" else None)


def test_an_isolated_test_on_a_shared_fixture_is_refused_naming_both() -> None:
    with pytest.raises(pytest.UsageError, match=r"test_y is marked isolated but uses the shared fixture\(s\) "
                                                r"\['ray_address'\]"):
        check_isolation(fake_item(["tmp_path", "ray_address"], isolated=True))


@pytest.mark.parametrize("fixtures,isolated", [(["ray_address"], False), (["tmp_path"], True)])
def test_a_sharing_test_or_an_isolated_one_on_its_own_passes(fixtures: list[str], isolated: bool) -> None:
    check_isolation(fake_item(fixtures, isolated))


def test_the_shared_ray_is_a_shared_fixture() -> None:
    assert {"shared_ray", "ray_address"} <= SHARED_FIXTURES
