"""The cache directory: the ``plait`` CLI reads PLAIT_CACHE_DIR / XDG_CACHE_HOME and
passes the directory down; the library (plait.train.corpus, plait.cost.profile) reads
no environment variable."""

from pathlib import Path

from plait.cli.environment import cache_dir
from plait.cli.main import main
from plait.train.corpus import load_corpus


def test_the_cli_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir({}) == tmp_path / "home" / ".cache" / "plait"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "plait"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg"),
                      "PLAIT_CACHE_DIR": str(tmp_path / "plait")}) == tmp_path / "plait"
    assert cache_dir({"PLAIT_CACHE_DIR": "~/mine"}) == tmp_path / "home" / "mine"  # ~ expanded, as before
    assert cache_dir({"PLAIT_CACHE_DIR": "", "XDG_CACHE_HOME": ""}) == tmp_path / "home" / ".cache" / "plait"
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "from-environ"))
    assert cache_dir() == tmp_path / "from-environ"  # default: os.environ, read when called


def _text(tmp_path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    return path


def test_the_library_reads_no_cache_variable(tmp_path, monkeypatch):
    """load_corpus given no directory caches nowhere, whatever the environment says."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "plait"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    corpus = load_corpus(str(_text(tmp_path)))
    assert corpus.nbytes == 44 * 50
    assert not any(path.exists() for path in (tmp_path / "plait", tmp_path / "xdg", tmp_path / "home"))
    given = tmp_path / "given"
    assert load_corpus(str(_text(tmp_path)), cache_dir=given).digest == corpus.digest
    assert [path.suffix for path in given.iterdir()] == [".npz"]


def test_plait_train_caches_the_corpus_in_plait_cache_dir(tmp_path, monkeypatch, capsys):
    """The launcher tokenises once into the CLI's cache directory (the ranks read it)."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["train", "--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--global-batch", "2",
            "--micro-batch", "2", "--dp", "1", "--tp", "1", "--pp", "1", "--data", str(_text(tmp_path)),
            "--out", str(tmp_path / "run"), "--dry-run"]
    assert main(argv) == 0, capsys.readouterr().err
    assert [path.name.startswith("corpus-") for path in (tmp_path / "cache").iterdir()] == [True]
