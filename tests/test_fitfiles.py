"""What runs measured, kept on disk between processes: where, whose, and what a reader makes of a bad file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from harmony import fitfiles


def test_the_directory_is_the_users_cache_or_the_one_named_and_none_when_named_empty(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HARMONY_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fitfiles.directory() == tmp_path / "xdg" / "harmony"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fitfiles.directory() == tmp_path / "home" / ".cache" / "harmony"
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path / "named"))
    assert fitfiles.directory() == tmp_path / "named"
    monkeypatch.setenv("HARMONY_CACHE_DIR", "")
    assert fitfiles.directory() is None and fitfiles.path("cpu") is None
    fitfiles.save("cpu", [{"name": "a"}])
    assert fitfiles.load("cpu") == []


def test_a_file_is_the_users_alone_replaced_whole_and_one_per_kind(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path / "cache"))
    runs = [{"name": "a", "at": 1.0, "plan": b"\x00\x01"}, {"name": "b", "at": 2.0, "plan": b""}]
    fitfiles.save("cpu", runs)
    file = fitfiles.path("cpu")
    assert file is not None and file.parent == tmp_path / "cache"
    assert stat.S_IMODE(file.parent.stat().st_mode) == 0o700 and stat.S_IMODE(file.stat().st_mode) == 0o600
    assert fitfiles.load("cpu") == runs and fitfiles.load("cuda") == []
    fitfiles.save("cpu", runs[1:])
    assert fitfiles.load("cpu") == runs[1:]
    assert [path.name for path in file.parent.iterdir()] == [file.name], "no temporary file left beside it"
    fitfiles.save("cuda", runs)
    fitfiles.save("cpu", runs[:1], "calibration")
    assert fitfiles.load("cpu", "calibration") == runs[:1] and fitfiles.load("cpu") == runs[1:], "a file for each"
    fitfiles.remove()
    assert list(file.parent.iterdir()) == []


def test_a_file_of_another_format_or_not_a_file_of_fits_reads_as_empty(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(tmp_path))
    file = fitfiles.path("cpu")
    assert file is not None
    for content in (b"not msgpack \xc1", b"\x93\x01\x02\x03", b"\x82\xa6format\x63\xa4runs\x90"):
        file.write_bytes(content)
        assert fitfiles.load("cpu") == []
    fitfiles.save("cpu", [{"name": "a"}])
    assert fitfiles.load("cpu") == [{"name": "a"}]


def test_an_unwritable_directory_keeps_nothing_and_raises_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("HARMONY_CACHE_DIR", str(blocker / "cache"))
    fitfiles.save("cpu", [{"name": "a"}])
    assert fitfiles.load("cpu") == []
