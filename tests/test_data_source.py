"""Where a run's data came from: an explicit $AKO_DATA_DIR that points nowhere is one line
(exit status 2, nothing written), and the summary and config.toml record the data's folder."""

from __future__ import annotations

import json
import tomllib

import pytest
from helpers import small_config
from test_data import _write_fixture

import ako
from ako.cli import main


def test_an_ako_data_dir_that_does_not_exist_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path / "nowhere"))
    code = main(["train", "--strategy", "allreduce", "--workers", "2", "--dataset", "fashion-mnist", "--epochs", "0.1",
                 "--no-progress", "--out-dir", str(tmp_path / "runs")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"ako: error: $AKO_DATA_DIR {str(tmp_path / 'nowhere')!r}: no such directory; ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["env", "flag"])
def test_the_summary_and_config_toml_record_the_data_s_folder(tmp_path, monkeypatch, where):
    data = _write_fixture(tmp_path / "idx" / "fashion-mnist", n_train=64, n_test=10)
    monkeypatch.setenv("AKO_DATA_DIR", str(tmp_path / "idx"))  # found in its fashion-mnist subfolder
    flag = {"data_dir": str(data)} if where == "flag" else {}
    config = small_config(tmp_path, strategy="allreduce", dataset="fashion-mnist", model="mlp", train_samples=None,
                          test_samples=None, batch_size=8, epochs=1.0, **flag)  # fmt: skip
    summary = ako.train(config).summary
    assert summary["data_source"] == str(data) and summary["iterations"] == 4
    with open(f"{summary['run_dir']}/config.toml", "rb") as f:
        assert tomllib.load(f)["data_dir"] == str(data)
    assert json.loads(open(f"{summary['run_dir']}/summary.json").read())["data_source"] == str(data)
