"""``diloco collect --output PATH`` through the real CLI: a directory (an existing one, or any path ending in
``/``) gets ``<run_id>.safetensors`` inside it, missing directories are created when the model is written, and a
path that cannot be written is refused in one line before anything is written. ``--help`` says all of it."""

from __future__ import annotations

from pathlib import Path

from support.store_cli import launch_small_run, run_cli

#: What these tests collect needs no training: a torch-free trainer whose replicas export the same weights.
AGREED = "support.cli_trainers:agreed"


def same_model(a: Path, b: Path) -> bool:
    """Two model files hold the same tensors (bitwise) and metadata (their headers' key order may differ)."""
    from diloco.store.codec import decode

    (ta, ma), (tb, mb) = decode(a.read_bytes()), decode(b.read_bytes())
    return ma == mb and sorted(ta) == sorted(tb) and all(ta[k].equal(tb[k]) for k in ta)


def test_collect_output_directory_forms_and_missing_parents(home: Path, tmp_path: Path) -> None:
    run_id = launch_small_run(home, trainer=AGREED)
    model = f"{run_id}.safetensors"

    into_new_dir = run_cli("collect", run_id, "--output", f"{tmp_path}/sub/", home=home)
    assert into_new_dir.returncode == 0, into_new_dir.stderr
    assert (tmp_path / "sub").is_dir() and (tmp_path / "sub" / model).is_file()

    into_existing_dir = run_cli("collect", run_id, "--output", str(tmp_path / "sub"), "--force", home=home)
    assert into_existing_dir.returncode == 0, into_existing_dir.stderr
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == [model]

    nested = tmp_path / "a" / "b" / "model.safetensors"
    into_missing_parents = run_cli("collect", run_id, "--output", str(nested), home=home)
    assert into_missing_parents.returncode == 0, into_missing_parents.stderr
    assert nested.is_file() and same_model(nested, tmp_path / "sub" / model)

    (tmp_path / "afile").write_text("not a directory")
    blocked = run_cli("collect", run_id, "--output", f"{tmp_path}/afile/deeper/", home=home)
    assert blocked.returncode == 2, blocked.stderr
    assert f"--output: {tmp_path}/afile is a file" in blocked.stderr
    assert len(blocked.stderr.strip().splitlines()) == 1 and (tmp_path / "afile").read_text() == "not a directory"

    shown = run_cli("collect", "--help", home=home)
    assert shown.returncode == 0
    help_text = " ".join(shown.stdout.replace("│", " ").split())
    assert "ending in /" in help_text and "missing directories are created" in help_text


def test_an_output_on_a_kernel_filesystem_is_refused_in_one_line_as_the_rendezvous_is(home: Path) -> None:
    """/proc and /sys take a path and refuse every write (root may "write" there by os.access): refused before
    any waiting, in the words ``--rendezvous`` gets, exit 2, never an internal error."""
    run_id = launch_small_run(home, trainer=AGREED)
    for command, target in (("collect", "/proc/model.safetensors"), ("plot", "/sys/plots/"),
                            ("collect", "/proc")):
        result = run_cli(command, run_id, "--output", target, home=home)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("diloco: error: --output: ") and "is on a kernel filesystem" in lines[0]
