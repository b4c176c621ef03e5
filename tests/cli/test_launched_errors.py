"""Under torchrun, an error line (exit 2) is printed once where every rank has it, by rank 0, and a rank's own
is printed by that rank, marked with its rank (tests/parallel/test_launch.py runs real two-process runs)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal

import pytest

import qklab.cli.commands as commands
from qklab.cli import main
from qklab.errors import LOCAL_RANK_0_SAYS, RANK_0_SAYS, ConfigError, alike


@pytest.fixture(autouse=True)
def _no_grace(monkeypatch):
    """A quiet rank's waits cut to nothing (under torchrun it would wait up to 60 s to be stopped), and the
    SIGTERM handler that wait sets put back."""
    monkeypatch.setattr(commands, "QUIET_GRACE_S", 0.0)
    monkeypatch.setattr(commands, "TORCHRUN_WAIT_S", 0.0)
    term = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, term)


def _launched(monkeypatch, rank: int, local: int | None = None, torchrun: bool = True) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank if local is None else local))
    if torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)


def _raising(monkeypatch, error: BaseException) -> None:
    def train(_args):
        raise error

    monkeypatch.setattr(commands, "_train", train)


def _cli(argv: list[str]) -> tuple[int, list[str]]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, [ln for ln in err.getvalue().splitlines() if ln.strip()]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_error_rank_0_has_too_is_rank_0s_line_alone(monkeypatch, rank):
    """Compared as the ranks agreed to stop (DistContext.agree): the same error on rank 0."""
    _launched(monkeypatch, rank)
    _raising(monkeypatch, alike(ConfigError("--resume: no usable checkpoint in c"), RANK_0_SAYS))
    code, err = _cli(["train"])
    assert code == 2
    assert err == (["qklab: error: --resume: no usable checkpoint in c"] if rank == 0 else []), err


def test_a_ranks_own_error_is_printed_by_it_with_its_rank(monkeypatch):
    _launched(monkeypatch, 1)
    _raising(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/local/disk/of/rank1"))
    code, err = _cli(["train"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("qklab: error (rank 1): No space left on device (/local/disk/of/rank1); free some space")


def test_an_error_of_unknown_kind_is_printed_on_every_rank_with_its_rank(monkeypatch):
    """Not compared, not the command line's: rather a line twice than a line lost."""
    _launched(monkeypatch, 3)
    _raising(monkeypatch, ConfigError("model.vocab_size=3 < tokenizer vocab 96"))
    assert _cli(["train"]) == (2, ["qklab: error (rank 3): model.vocab_size=3 < tokenizer vocab 96"])


BAD = ["train", "--set", "train.steps=-1"]
LINE = "train.steps=-1 is out of range: it must be > 0"


@pytest.mark.parametrize("rank, local, torchrun, line", [
    (0, 0, True, f"qklab: error: {LINE}"),
    (1, 1, True, None),  # started by the same torchrun as rank 0: the same command line, the same files
    (2, 0, True, f"qklab: error (rank 2): {LINE}"),  # the first process of another machine: its own files
    (3, 1, True, None),  # ... which says it for the others there
    (1, 1, False, f"qklab: error (rank 1): {LINE}"),  # another launcher: nothing says the command lines match
])
def test_a_bad_config_value_is_said_once_per_machine(monkeypatch, rank, local, torchrun, line):
    _launched(monkeypatch, rank, local, torchrun)
    assert _cli(BAD) == (2, [] if line is None else [line])


@pytest.mark.parametrize("rank, local, line", [
    (0, 0, "qklab: error: unrecognized arguments: --nope (see qklab --help)"),
    (1, 1, None),
    (2, 0, "qklab: error (rank 2): unrecognized arguments: --nope (see qklab --help)"),
])
def test_a_bad_option_is_said_once_per_machine(monkeypatch, rank, local, line):
    _launched(monkeypatch, rank, local)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        main(["train", "--nope"])
    assert stop.value.code == 2
    assert err.getvalue().splitlines() == ([] if line is None else [line])


def test_the_launcher_mismatch_is_the_command_lines(monkeypatch):
    from qklab.parallel.context import DistContext

    _launched(monkeypatch, 1)
    with pytest.raises(ConfigError) as e:
        DistContext.start("none")
    assert commands._error_line("x", e.value) is None
    assert commands._error_line("x", ConfigError("x")) == "qklab: error (rank 1): x"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert commands._error_line("x", e.value) == "qklab: error (rank 1): x"
    assert commands._error_line("x", alike(ConfigError("x"), LOCAL_RANK_0_SAYS)) == "qklab: error (rank 1): x"


GLOO_PEER_GONE = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                              "[127.0.0.1]:41145. This is typically caused by a remote worker crashing.")


STOPPED = ("another process of this run stopped or was lost during a collective step (its own line, or the "
           "launcher's log of that rank, says why); run the same command again")


@pytest.mark.parametrize("first", [0, 2])
def test_a_collective_whose_partner_is_gone_is_a_stop_said_once(monkeypatch, first):
    """Another rank stopped first (and said why, or was killed): the first survivor to get here says once
    that another process stopped, and how to go on, marked with its rank unless it is rank 0; the others
    are quiet. No traceback, no "internal error" (tests/parallel/test_launch.py has real torchrun runs)."""
    from datetime import timedelta

    import torch.distributed as tdist

    from tests.parallel.common import free_port

    port = free_port()
    store = tdist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),  # torchrun's agent
                           wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    _raising(monkeypatch, GLOO_PEER_GONE)
    said = {}
    for rank in (first, 1, 2 - first, 3):
        _launched(monkeypatch, rank)
        said[rank] = _cli(["train"])
    marked = "" if first == 0 else f" (rank {first})"
    assert said.pop(first) == (1, [f"qklab: stopped{marked}: {STOPPED}"])
    assert all(v == (1, []) for v in said.values()), said
    del store


def test_a_sigterm_while_the_line_is_said_is_held_then_let_through(monkeypatch):
    """torchrun stops the survivors (SIGTERM) once it sees a process gone, maybe while one is deciding and
    saying its line: the line is still said whole, and the SIGTERM is delivered after it, not dropped."""
    import qklab.parallel.context as context

    got: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))  # the process's own (the fixture restores)

    def first_to_say(what):
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun's stop, now
        got.append("asked")
        return True

    monkeypatch.setattr(context, "first_to_say", first_to_say)
    _raising(monkeypatch, GLOO_PEER_GONE)
    _launched(monkeypatch, 1)
    assert _cli(["train"]) == (1, [f"qklab: stopped (rank 1): {STOPPED}"])
    assert got == ["asked", "SIGTERM"]


def test_a_partner_gone_without_a_store_to_ask_is_said_by_each(monkeypatch):
    """No launcher's store to ask (it lived in the lost process): every survivor says it, rather than none."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there
    import qklab.parallel.context as context

    monkeypatch.setattr(context, "SAY_TIMEOUT_S", 0.2)
    _raising(monkeypatch, GLOO_PEER_GONE)
    for rank in (0, 1):
        _launched(monkeypatch, rank)
        marked = "" if rank == 0 else f" (rank {rank})"
        assert _cli(["train"]) == (1, [f"qklab: stopped{marked}: {STOPPED}"])


def test_the_same_error_in_one_process_is_still_a_bug(monkeypatch):
    """Without a launcher no partner can be gone: the error is qklab's, with its traceback."""
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    _raising(monkeypatch, GLOO_PEER_GONE)
    code, err = _cli(["train"])
    assert code == 1 and err[0] == "Traceback (most recent call last):"
    assert err[-1] == "qklab: internal error (a bug in qklab, not in your input): RuntimeError", err
