"""The folders of a ``harness run`` (harness.results.launch.open_runs): opened before the first cell,
each locked while its run writes, and none left open when opening a later one fails."""

import textwrap

import pytest

from harness.results import launch
from harness.results.store import RunStore
from harness.spec.errors import HarnessError

CONFIG = textwrap.dedent("""
    name: {name}
    seed: 1
    dtype: float64
    model: {{kind: elman, hidden: 4}}
    task: {{kind: random, input_size: 3, output_size: 3, seq_len: 3, n_sequences: 4}}
    workloads: [forward]
    batch: [2]
    backends: [ref]
""")


def _configs(write_config, *names):
    return [write_config(CONFIG.format(name=n), name=f"{n}.yaml") for n in names]


def test_each_config_gets_a_locked_folder_until_the_runs_close(fake_backends, write_config, tmp_path):
    one = tmp_path / "one"
    with launch.open_runs(_configs(write_config, "a"), out=one) as runs:
        assert [(cfg.name, store.path) for cfg, store in runs] == [("a", one)]
        with pytest.raises(HarnessError, match="another run is writing to this folder"):
            RunStore.open(one, lock=True)
    RunStore.open(one, lock=True).close()  # closed with the runs: a resume may take it
    with launch.open_runs(_configs(write_config, "b", "c"), out=tmp_path / "many") as runs:
        assert [cfg.name for cfg, _ in runs] == ["b", "c"]
        assert all(store.path.parent == tmp_path / "many" for _, store in runs)


def test_a_folder_that_cannot_be_made_leaves_none_of_the_others_open(fake_backends, write_config, tmp_path,
                                                                     monkeypatch):
    made = []
    real = RunStore.create_unique.__func__

    def second_fails(cls, parent, meta):
        if made:
            raise HarnessError(f"{parent}: no space left on the device")
        made.append(real(cls, parent, meta))
        return made[-1]

    monkeypatch.setattr(RunStore, "create_unique", classmethod(second_fails))
    with pytest.raises(HarnessError, match="no space left"):
        launch.open_runs(_configs(write_config, "a", "b"), out=tmp_path / "runs")
    RunStore.open(made[0].path, lock=True).close()  # the first folder's lock was let go


def test_resume_takes_the_one_config_the_run_started_with(fake_backends, write_config, tmp_path):
    configs = _configs(write_config, "a", "b")
    with launch.open_runs(configs[:1], out=tmp_path / "run"):
        pass
    with pytest.raises(HarnessError, match="--resume takes one config"):
        launch.open_runs(configs, resume=tmp_path / "run")
    with pytest.raises(HarnessError, match="started with another config"):
        launch.open_runs(configs[1:], resume=tmp_path / "run")
    with launch.open_runs(configs[:1], resume=tmp_path / "run") as runs:
        assert [store.path for _, store in runs] == [tmp_path / "run"] and runs.ended_workers == []
