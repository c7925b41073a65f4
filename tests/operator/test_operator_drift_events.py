"""Which child events count as an edit by someone else (and trigger a full reconcile)."""

from __future__ import annotations

from typing import Any

from kvflow.operator import names
from kvflow.operator.handlers import EditFilter, edited_by_others


def _body(*managers: tuple[str, str | None], generation: int | None = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "uid": "u1",
        "resourceVersion": "100",
        "managedFields": [
            {"manager": m, "operation": "Update", **({"subresource": sub} if sub else {})}
            for m, sub in managers
        ],
    }
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta}


def test_only_the_operator_and_controllers_is_no_edit() -> None:
    body = _body(
        (names.FIELD_MANAGER, None),
        ("kube-controller-manager", None),
        ("kwok-controller", "status"),
    )
    assert not edited_by_others(body)
    assert edited_by_others(_body((names.FIELD_MANAGER, None), ("kubectl", "scale")))


def test_each_edit_is_repaired_once() -> None:
    edits = EditFilter()
    edited = _body((names.FIELD_MANAGER, None), ("kubectl", "scale"), generation=4)
    assert edits.new_edit(edited)
    # Status events of the same spec (kubectl's entry is still there): no new repair.
    assert not edits.new_edit(edited)
    # The repair's apply moved the generation: one more (no-op) reconcile, then quiet.
    repaired = _body((names.FIELD_MANAGER, None), ("kubectl", "scale"), generation=5)
    assert edits.new_edit(repaired)
    assert not edits.new_edit(repaired)
    # A second edit is a new spec again.
    assert edits.new_edit(_body(("kubectl", "scale"), generation=6))


def test_kinds_without_generation_use_the_resource_version() -> None:
    edits = EditFilter()
    config = _body(("kubectl-edit", None), generation=None)
    assert edits.new_edit(config)
    assert not edits.new_edit(config)
    config["metadata"]["resourceVersion"] = "101"
    assert edits.new_edit(config)


def test_a_deleted_child_is_forgotten() -> None:
    edits = EditFilter()
    body = _body(("kubectl", "scale"))
    assert edits.new_edit(body)
    edits.forget(body)
    assert edits.new_edit(body)
