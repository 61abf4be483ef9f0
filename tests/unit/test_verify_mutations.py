"""``verify.mutations``: the catalogue of mutants that ``python -m verify mutants`` runs.

Every mutant applies to the tree as it is (each text it replaces occurs exactly once), so
a refactor that moves the code fails here instead of leaving a mutant that changes
nothing; the catalogue covers every rule with well-formed entries, each naming a test
that still exists; ``apply`` refuses a text that is missing or not unique and then
writes nothing; ``by_name`` refuses an unknown name, listing the known ones.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from verify.mutants import baseline_name, build_parser, verify_argv
from verify.mutations import (
    DATABASES,
    MUTANTS,
    RULES,
    Edit,
    Mutant,
    MutationError,
    apply,
    by_name,
)

ROOT = Path(__file__).resolve().parents[2]
KEBAB = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_edit_replaces_a_text_that_occurs_once(mutant: Mutant) -> None:
    if mutant.pending:
        pytest.skip(f"pending: {mutant.pending}")
    for edit in mutant.edits:
        text = (ROOT / edit.path).read_text(encoding="utf-8")
        assert text.count(edit.old) == 1, (mutant.name, edit.path, edit.old)
        assert edit.new != edit.old


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_a_copy_of_the_files_it_edits(
    mutant: Mutant, tmp_path: Path
) -> None:
    if mutant.pending:
        with pytest.raises(MutationError, match="pending"):
            apply(mutant, tmp_path)
        pytest.skip(f"pending: {mutant.pending}")
    paths = {edit.path for edit in mutant.edits}
    for path in paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, tmp_path / path)
    apply(mutant, tmp_path)
    for edit in mutant.edits:
        assert edit.new in (tmp_path / edit.path).read_text(encoding="utf-8")
    for path in paths:
        assert (tmp_path / path).read_bytes() != (ROOT / path).read_bytes()


def test_the_catalogue_covers_every_rule() -> None:
    names = [mutant.name for mutant in MUTANTS]
    assert len(names) == len(set(names))
    assert len(MUTANTS) >= 8
    assert {mutant.rule for mutant in MUTANTS} == RULES
    # CI's fast set guards the promise's rules, and stays short (ten runs in CI; the
    # eighth, duplicates-reused-key-replayed, dies within 2 s of the window's opening, the
    # ninth, source-fence-off-by-one, within 3 s: about 15 s a run, start and end included;
    # the tenth, source-etcd-cache-forever, within 25 s, beside a baseline of its own
    # workload, the etcd lock workers: about two minutes more; the eleventh,
    # upstream-bytes-outlive-the-exchange, within 10 s, beside a baseline of the
    # resolving workload: two minutes more).
    fast = [mutant for mutant in MUTANTS if mutant.fast]
    assert {"fence", "barrier", "expiry", "lease-source"} <= {mutant.rule for mutant in fast}
    assert len(fast) <= 11


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_entry_is_well_formed(mutant: Mutant) -> None:
    assert KEBAB.fullmatch(mutant.name), mutant.name
    assert mutant.rule in RULES
    assert mutant.databases <= DATABASES
    assert mutant.databases or not mutant.fast  # CI's fast set runs
    assert mutant.edits
    assert mutant.why[:1].isupper() and mutant.why.endswith(".")


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_the_test_that_kills_it_still_exists(mutant: Mutant) -> None:
    path, _, function = mutant.killed_by.partition("::")
    assert path.startswith("tests/") and function, mutant.killed_by
    if mutant.pending:
        pytest.skip(f"pending: {mutant.pending} (its test comes with it)")
    source = (ROOT / path).read_text(encoding="utf-8")
    assert re.search(rf"^(async )?def {re.escape(function)}\(", source, re.MULTILINE), function


def _mutant(*edits: Edit) -> Mutant:
    return Mutant("test-only", "fence", frozenset({"sqlite"}), edits, "A test's mutant.")


def test_apply_replaces_each_text(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n", encoding="utf-8")
    apply(_mutant(Edit("a.py", "x = 1", "x = 2"), Edit("a.py", "y = 2", "y = 3")), tmp_path)
    assert (tmp_path / "a.py").read_text(encoding="utf-8") == "x = 2\ny = 3\n"


@pytest.mark.parametrize(("old", "count"), [("z = 1", 0), ("= 1", 2)])
def test_apply_refuses_a_text_missing_or_twice_and_writes_nothing(
    tmp_path: Path, old: str, count: int
) -> None:
    before = {"a.py": "x = 1\ny = 1\n", "b.py": "b = 1\n"}
    for name, text in before.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    mutant = _mutant(Edit("b.py", "b = 1", "b = 2"), Edit("a.py", old, "changed"))
    expected = f"a.py: the text to replace occurs {count} times"
    with pytest.raises(MutationError, match=re.escape(expected)):
        apply(mutant, tmp_path)
    for name, text in before.items():
        assert (tmp_path / name).read_text(encoding="utf-8") == text


def test_apply_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(MutationError, match=re.escape("cannot read nowhere.py")):
        apply(_mutant(Edit("nowhere.py", "x", "y")), tmp_path)


def test_by_name_gives_the_mutants_in_the_order_asked() -> None:
    last, first = MUTANTS[-1], MUTANTS[0]
    assert by_name([last.name, first.name]) == [last, first]
    assert by_name([]) == []


def test_by_name_refuses_an_unknown_name_listing_the_known_ones() -> None:
    with pytest.raises(MutationError, match="no mutant named 'no-such-mutant'") as raised:
        by_name([MUTANTS[0].name, "no-such-mutant"])
    for mutant in MUTANTS:
        assert mutant.name in str(raised.value)


def test_a_pending_mutant_is_refused_and_not_chosen_to_run(tmp_path: Path) -> None:
    from verify.mutants import build_parser, chosen

    (tmp_path / "a.py").write_text("x = 1\n", encoding="utf-8")
    pending = Mutant(
        "test-only", "fence", frozenset({"sqlite"}), (Edit("a.py", "x = 1", "x = 2"),),
        "A test's mutant.", pending="a change not merged yet",
    )  # fmt: skip
    with pytest.raises(MutationError, match="pending"):
        apply(pending, tmp_path)
    assert (tmp_path / "a.py").read_text(encoding="utf-8") == "x = 1\n"
    everything = chosen(build_parser().parse_args([]))
    assert everything and not any(m.pending for m in everything)


def test_a_mutant_with_run_arguments_has_a_baseline_of_its_own() -> None:
    """``run_args``: the resolver's mutant runs with ``--resolving`` (a workload that masks
    barrier-quick-admission), and so does the unmutated tree it is judged against."""
    resolver = next(m for m in MUTANTS if m.name == "resolver-window-sign")
    assert resolver.run_args == ("--resolving",)
    assert not next(m for m in MUTANTS if m.name == "barrier-quick-admission").run_args
    assert baseline_name(()) == "none"
    assert baseline_name(resolver.run_args) == "none+resolving"
    options = build_parser().parse_args([])
    argv = verify_argv(options, "sqlite", 2, Path("/tmp/x"), resolver.run_args)
    assert argv[-1] == "--resolving" and "--stop-on-violation" in argv
