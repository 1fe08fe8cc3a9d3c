"""The intra-op thread count is one field (``base.threads.ThreadPool``) embedded in every settings dataclass that
takes it: one declaration, one --threads option, the old flat records still read."""

import dataclasses

import pytest
import typer.main

from bdlora.base.argv import embedded, fields_of, option_values
from bdlora.base.errors import Checks, ConfigError, UsageError, usable_cores
from bdlora.base.io import read_json, write_json
from bdlora.base.threads import MAX_GENAI_THREADS, ThreadPool, flat, from_options
from bdlora.bench.config import BenchConfig
from bdlora.compress.config import OneShotConfig
from bdlora.export.settings import GenaiExportConfig
from bdlora.serve.config import ServeConfig
from bdlora.ship.config import ShipConfig
from bdlora.speculative.run import GenerateConfig

SETTINGS = (OneShotConfig, GenaiExportConfig, BenchConfig, GenerateConfig, ServeConfig, ShipConfig)
COMMANDS = {("compress",): OneShotConfig, ("export", "genai"): GenaiExportConfig, ("bench",): BenchConfig,
            ("generate",): GenerateConfig, ("serve",): ServeConfig, ("ship",): ShipConfig}


def test_threads_is_declared_once_and_embedded_in_every_settings_dataclass():
    for cls in SETTINGS:
        own = {f.name for f in dataclasses.fields(cls)}
        assert "threads" not in own and embedded(cls)["pool"] is ThreadPool, cls.__name__
        assert fields_of(cls)["threads"] is ThreadPool, cls.__name__
    # bench's rounding is export genai's settings, pool and all: bench's --threads is its own pool's
    assert embedded(BenchConfig) == {"pool": ThreadPool, "rounding": GenaiExportConfig}


@pytest.mark.parametrize("path", list(COMMANDS))
def test_every_command_takes_the_pool_as_one_threads_option(path):
    from bdlora.cli import app
    from bdlora.cli.options import COMMON

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    params = {p.name: p for p in cmd.params}
    assert "pool" not in params and [p.name for p in cmd.params].count("threads") == 1
    assert params["threads"].opts == ["--threads"] and params["threads"].help == COMMON["threads"]


def test_from_options_routes_threads_into_the_pool_and_flat_writes_it_back():
    cfg = from_options(ShipConfig, {"threads": 2, "speedups": "1.3"})
    assert cfg.pool == ThreadPool(2) and cfg.speedups == "1.3"
    assert flat(cfg)["threads"] == 2 and "pool" not in flat(cfg)
    assert flat(cfg) == {**flat(ShipConfig()), "threads": 2, "speedups": "1.3"}
    # a pool given whole is taken as it is; bench's rounding keeps its own (default) pool
    bench = from_options(BenchConfig, {"threads": 1, "rounding": GenaiExportConfig(quant="gptq")})
    assert bench.pool.threads == 1 and bench.rounding.pool.threads is None and bench.rounding.quant == "gptq"
    with pytest.raises(TypeError, match="thread"):
        from_options(ShipConfig, {"thread": 2})
    # a command that runs another gives the pool's field as the option it is
    assert option_values(GenaiExportConfig, threads=3) == {"threads": "3"}


def test_the_pool_counts_and_checks_as_each_command_needs():
    assert ThreadPool().count == usable_cores() and ThreadPool(1).count == 1
    with pytest.raises(ConfigError, match=f"--threads {usable_cores() + 1}: must be"):
        GenerateConfig(pool=ThreadPool(usable_cores() + 1)).check(Checks()).done()
    # export genai writes the count for the machine the folder runs on: 0 (none) up to MAX_GENAI_THREADS
    GenaiExportConfig(pool=ThreadPool(0)).check(Checks()).done()
    GenaiExportConfig(pool=ThreadPool(MAX_GENAI_THREADS)).check(Checks()).done()
    with pytest.raises(ConfigError, match=f"--threads {MAX_GENAI_THREADS + 1}: must be in"):
        GenaiExportConfig(pool=ThreadPool(MAX_GENAI_THREADS + 1)).check(Checks()).done()


def test_a_ship_folder_written_with_flat_threads_resumes(tmp_path):
    """ship.json written before the pool was embedded holds "threads": 2 among its options: the same settings
    resume it, other threads are named as the flag."""
    from bdlora.base.runs import SHIP_OPTIONS
    from bdlora.ship.run import start

    folder = tmp_path / "ship"
    folder.mkdir()
    before = {f.name: getattr(ShipConfig(), f.name) for f in dataclasses.fields(ShipConfig) if f.name != "pool"}
    write_json(folder / SHIP_OPTIONS, {"model": "builtin", "options": {**before, "threads": 2}})
    assert start("builtin", ShipConfig(pool=ThreadPool(2)), folder) is True
    assert read_json(folder / SHIP_OPTIONS)["options"]["threads"] == 2
    with pytest.raises(UsageError, match=r"--threads 2 \(given 1\)"):
        start("builtin", ShipConfig(pool=ThreadPool(1)), folder)
