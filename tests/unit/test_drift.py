"""Drift within a model group, the diff of two descriptions, and the router's model groups."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.drift import Difference, DriftField, diff, drift_key, find_drift
from controlplane.replica_info import ReplicaInfo, ServedModel
from router.fleet.groups import drift_changes, model_groups

M = "tiny-llama"


def info(
    block: int = 32,
    ctx: int = 1024,
    caching: bool = True,
    algo: str = "sha256",
    version: str = "0.32.0",
    models: tuple[str, ...] = (M,),
) -> ReplicaInfo:
    return ReplicaInfo(
        url="http://r",
        models=tuple(ServedModel(m, ctx, f"/models/{m}") for m in models),
        block_size=block,
        num_gpu_blocks=1000,
        enable_prefix_caching=caching,
        prefix_caching_hash_algo=algo,
        version=version,
    )


@pytest.mark.parametrize(
    ("fleet", "drifted"),
    [
        ({"a": info(), "b": info()}, {}),
        # a tie goes to the configuration of the smallest id
        ({"a": info(), "b": info(block=64)}, {"b": (DriftField.BLOCK_SIZE,)}),
        ({"b": info(), "a": info(block=64)}, {"b": (DriftField.BLOCK_SIZE,)}),
        # the majority wins, whatever the ids
        (
            {"a": info(block=64), "b": info(), "c": info()},
            {"a": (DriftField.BLOCK_SIZE,)},
        ),
        (
            {"a": info(), "b": info(), "c": info(ctx=4096, version="0.33.0")},
            {"c": (DriftField.MAX_MODEL_LEN, DriftField.VERSION)},
        ),
        (
            {"a": info(), "b": info(caching=False, algo="sha256_cbor"), "c": info()},
            {"b": (DriftField.PREFIX_CACHING, DriftField.HASH_ALGO)},
        ),
        # a replica of another model is not part of the group
        ({"a": info(), "x": info(block=64, models=("other",))}, {}),
        ({}, {}),
    ],
)
def test_find_drift(
    fleet: dict[str, ReplicaInfo], drifted: dict[str, tuple[DriftField, ...]]
) -> None:
    assert dict(find_drift(fleet, M).drifted) == drifted


def test_the_reference_names_its_fields() -> None:
    group = find_drift({"a": info(), "b": info()}, M)
    assert group.reference_dict() == {
        "block_size": 32,
        "max_model_len": 1024,
        "prefix_caching": True,
        "hash_algo": "sha256",
        "version": "0.32.0",
    }


variants = st.builds(
    info,
    block=st.sampled_from([32, 64]),
    ctx=st.sampled_from([512, 1024]),
    caching=st.booleans(),
    version=st.sampled_from(["0.32.0", "0.33.0"]),
)


@given(st.dictionaries(st.sampled_from("abcdefg"), variants, min_size=1))
def test_drift_invariants(fleet: dict[str, ReplicaInfo]) -> None:
    group = find_drift(fleet, M)
    keys = {rid: drift_key(i, M) for rid, i in fleet.items()}
    # the reference is a configuration some replica has, and no other is more common
    assert group.reference in keys.values()
    count = list(keys.values()).count
    ref = group.reference
    assert ref is not None and all(count(ref) >= count(k) for k in keys.values())
    # drifted = exactly the replicas unlike the reference, each with a non-empty reason
    assert set(group.drifted) == {rid for rid, k in keys.items() if k != group.reference}
    assert all(group.drifted.values())
    # fewer than half can be drifted only when the majority is strict; never all of them
    assert len(group.drifted) < len(fleet)
    # independent of the mapping's order
    assert find_drift(dict(reversed(list(fleet.items()))), M) == group


def test_diff_lists_every_difference_in_a_stable_order() -> None:
    a = info()
    b = replace(
        info(block=64, ctx=512, version="0.33.0", models=(M, "lora1")),
        cache_labels={"kv_cache_max_concurrency": "2048.0"},
    )
    assert diff(a, a) == ()
    assert diff(a, b) == (
        Difference("models", [M], ["lora1", M]),
        Difference(f"model[{M}].max_model_len", 1024, 512),
        Difference("block_size", 32, 64),
        Difference("version", "0.32.0", "0.33.0"),
        Difference("cache_config.kv_cache_max_concurrency", None, "2048.0"),
    )


@given(variants, variants)
def test_diff_is_symmetric(a: ReplicaInfo, b: ReplicaInfo) -> None:
    ab, ba = diff(a, b), diff(b, a)
    assert [(d.field, d.a, d.b) for d in ab] == [(d.field, d.b, d.a) for d in ba]
    assert (ab == ()) == (a == b)


def test_model_groups_and_their_drift_changes() -> None:
    fleet = {
        "a": info(ctx=512),
        "b": info(ctx=512, block=64),
        "o": info(ctx=4096, models=("other",)),
    }
    groups = model_groups(fleet)
    assert groups.models == ("other", M)
    main, other = groups.get(M), groups.get("other")
    assert main is not None and other is not None
    assert (set(main.members), set(main.affinity_excluded)) == ({"a", "b"}, {"b"})
    assert (main.block_size, main.max_model_len) == (32, 512)
    assert (set(other.members), other.max_model_len) == ({"o"}, 4096)
    assert not other.affinity_excluded
    assert groups.get("missing") is None
    assert groups.drift_of() == {"b": ((M, DriftField.BLOCK_SIZE),)}

    healed = model_groups({**fleet, "b": info(ctx=512)})
    assert drift_changes(groups, healed) == [("b", ())]
    assert drift_changes(groups, groups) == []
    worse = model_groups(
        {**fleet, "a": info(ctx=512, version="0.33.0"), "c": info(ctx=512), "d": info(ctx=512)}
    )
    assert drift_changes(groups, worse) == [
        ("a", ((M, DriftField.VERSION),)),
    ]


def test_a_request_goes_only_to_members_whose_context_holds_it() -> None:
    fleet = {"a": info(ctx=1024), "b": info(ctx=1024), "c": info(ctx=512)}
    fleet["u"] = ReplicaInfo(url="http://u", models=(ServedModel(M, None),), block_size=32)
    group = model_groups(fleet).get(M)
    assert group is not None and group.max_model_len == 1024
    assert group.fitting(512) == {"a", "b", "c", "u"}
    # the drifted member with the shorter context is left out; one that did not say is kept
    assert group.fitting(513) == {"a", "b", "u"}
    assert group.fitting(1025) == {"u"}
