"""The relay on its own: pipes in, prefixed whole lines out (no processes)."""

import io
import os
import sys
import time

from mpddp.core.launcher.output import Relay


def relay_bytes(chunks_by_rank: dict[int, list[bytes]], monkeypatch, **kwargs) -> tuple[str, str, Relay]:
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    relay = Relay(kwargs.get("output_ranks"), kwargs.get("log_dir"), prefix=kwargs.get("prefix", True))
    writers = {}
    for rank in chunks_by_rank:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        relay.add(rank, out_r, err_r)
        writers[rank] = (out_w, err_w)
    relay.start()
    for rank, chunks in chunks_by_rank.items():
        for chunk in chunks:
            os.write(writers[rank][0], chunk)
    for out_w, err_w in writers.values():
        os.close(out_w)
        os.close(err_w)
    relay.stop(5)
    return out.getvalue(), err.getvalue(), relay


def test_lines_split_across_writes_are_joined_and_prefixed(monkeypatch):
    out, _, relay = relay_bytes({3: [b"hel", b"lo\nwor", b"ld\nno newline at end"]}, monkeypatch)
    assert out.splitlines() == ["[rank 3] hello", "[rank 3] world", "[rank 3] no newline at end"]
    assert relay.tail(3) == ["hello", "world", "no newline at end"]


def test_progress_bar_redraws_in_place_and_the_next_line_overwrites_it(monkeypatch):
    out, _, relay = relay_bytes({0: [b"\r10%|#  \r", b"100%|####\r", b"ok\n", b"next\n"]}, monkeypatch)
    assert out == (
        "\r[rank 0] 10%|#  "
        "\r[rank 0] 100%|####"
        "\r[rank 0] ok       \n"  # padded to cover the 18 characters of the last bar
        "[rank 0] next\n"
    )
    assert relay.tail(0) == ["ok", "next"]  # bars never reach tails or log files


def test_utf8_split_mid_character_and_crlf(monkeypatch):
    text = "ünïcode ✓\r\n".encode()
    out, _, _ = relay_bytes({1: [text[:2], text[2:]]}, monkeypatch)
    assert out == "[rank 1] ünïcode ✓\n"


def test_output_filter_hides_stdout_but_never_stderr(monkeypatch, tmp_path):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    buf_out, buf_err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf_out)
    monkeypatch.setattr(sys, "stderr", buf_err)
    relay = Relay((0,), str(tmp_path))
    relay.add(1, out_r, err_r)
    relay.start()
    os.write(out_w, b"chatty\n")
    os.write(err_w, b"Traceback: boom\n")
    os.close(out_w)
    os.close(err_w)
    relay.stop(5)
    assert buf_out.getvalue() == ""
    assert buf_err.getvalue() == "[rank 1] Traceback: boom\n"
    # one unprefixed log per rank, stdout and stderr together (their order across two pipes is not fixed)
    assert sorted((tmp_path / "rank1.log").read_text().splitlines()) == ["Traceback: boom", "chatty"]


def test_no_prefix_prints_lines_as_written_and_whole(monkeypatch):
    out, err, relay = relay_bytes({0: [b"{\"a\": ", b"1}\n", b"tail"], 1: [b"x\r\n"]}, monkeypatch, prefix=False)
    assert sorted(out.splitlines()) == ["tail", "x", '{"a": 1}']
    assert out.endswith("\n") and relay.tail(0) == ['{"a": 1}', "tail"]


def test_a_progress_bar_interrupted_by_another_rank_is_ended_first(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    relay = Relay(None, None)
    pipes = {rank: (os.pipe(), os.pipe()) for rank in (0, 1)}
    for rank, ((out_r, _), (err_r, _)) in pipes.items():
        relay.add(rank, out_r, err_r)
    relay.start()
    os.write(pipes[0][0][1], b"50%|##  \r")
    deadline = time.monotonic() + 5
    while "50%" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.write(pipes[1][0][1], b"loss 0.3\n")
    for (_, out_w), (_, err_w) in pipes.values():
        os.close(out_w)
        os.close(err_w)
    relay.stop(5)
    # never "[rank 0] 50%|##[rank 1] loss 0.3" on one line
    assert out.getvalue() == "\r[rank 0] 50%|##  \n[rank 1] loss 0.3\n"
