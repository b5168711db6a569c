"""_args.writable_file when several processes probe one path at once (torchrun's ranks do, at argument parsing)."""
import threading
from pathlib import Path

from ampcourse import _args


def test_ranks_probing_one_path_at_once_never_see_a_vanished_file(tmp_path: Path) -> None:
    # CI once failed a 2-rank FSDP run: rank 1's probe unlinked history.json between rank 0's open and its
    # stat by name, and rank 0 reported "No such file or directory" for a folder it could write.
    target = tmp_path / "history.json"
    errors: list[str] = []
    start = threading.Barrier(4)

    def probe() -> None:
        start.wait()
        for _ in range(1500):
            try:
                _args.writable_file(str(target), "--history-out")
            except ValueError as err:
                errors.append(str(err))
                return

    threads = [threading.Thread(target=probe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_an_unwritable_path_is_still_refused(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder" / "history.json"
    try:
        _args.writable_file(str(missing), "--history-out")
    except ValueError as err:
        assert "folder does not exist" in str(err)
    else:
        raise AssertionError("a path in a missing folder was accepted")


def test_first_line_is_the_one_reading_of_an_error_message():
    from ampcourse._args import first_line
    assert first_line(RuntimeError("\n  mat1 and mat2 shapes cannot be multiplied\n(4x8 and 3x8)")) == \
        "mat1 and mat2 shapes cannot be multiplied"
    assert first_line(ValueError(""), default="ValueError") == "ValueError"
    assert first_line("abcdef", 3) == "abc"


def test_parse_or_status_returns_the_status_a_main_returns(capsys):
    """The CLIs' one parse step: arguments, or 0 after --help and 2 after a bad flag (one line on stderr)."""
    from ampcourse import _args

    ap = _args.OneLineParser(prog="python -m demo", error_prefix="demo")
    ap.add_argument("--steps", type=int, default=1)
    assert ap.parse_or_status(["--steps", "3"]).steps == 3
    assert ap.parse_or_status(["--help"]) == 0
    capsys.readouterr()
    assert ap.parse_or_status(["--steps", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("demo: error: argument --steps") and err.count("\n") == 1
