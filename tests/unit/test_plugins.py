"""Plugins through entry points (``edgestream.plugins``): a distribution installed on the path
adds a model, a strategy, a codec and a data source, loaded when a registry is asked for a
name it does not hold (or lists its names), once; one that fails is named in one line.

The distributions here are real to ``importlib.metadata``: a ``*.dist-info`` folder with its
METADATA and entry_points.txt beside the plugin's package, in a folder put on ``sys.path``.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from edgestream import plugins
from edgestream.compression import registry as codecs
from edgestream.compression.errors import CompressorConfigError
from edgestream.job.errors import ConfigError
from edgestream.job.sources import base as sources
from edgestream.trainers import models
from edgestream.trainers.errors import ModelConfigError, UnknownStrategyError
from edgestream.trainers.strategies import base as strategies

_counter = itertools.count()

#: The plugin's modules: each registers one thing named with the test's suffix ``{n}`` and
#: appends a line to the import log, so a test can count how often it was imported.
MODULES = {
    "models": '''
        from torch import nn
        from edgestream.trainers.models import register_model

        @register_model("fake_net_{n}")
        def build(input_shape, num_classes):
            return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))
    ''',
    "strategies": '''
        from edgestream.trainers.strategies.base import register
        from edgestream.trainers.strategies.bsp import BSPStrategy

        @register("fake_strategy_{n}")
        class FakeStrategy(BSPStrategy):
            name = "fake_strategy_{n}"
    ''',
    "codecs": '''
        from edgestream.compression.fp16 import Fp16Compressor
        from edgestream.compression.registry import register

        @register("fake_codec_{n}")
        class FakeCodec(Fp16Compressor):
            codec_id = {codec_id}
    ''',
    "sources": '''
        from edgestream.job.sources.base import DataSource, register

        @register("fake_source_{n}")
        class FakeSource(DataSource):
            def fleet_data(self, cfg):
                raise NotImplementedError
    ''',
}
GROUP_OF = {"models": plugins.MODELS, "strategies": plugins.STRATEGIES, "codecs": plugins.CODECS,
            "sources": plugins.SOURCES}


@pytest.fixture(autouse=True)
def fresh_registries(monkeypatch):
    """Every registry and the loader's memory as copies: what a test's plugins register is gone after it."""
    monkeypatch.setattr(plugins, "_LOADED", {})
    monkeypatch.setattr(models, "_MODELS", dict(models._MODELS))
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))
    monkeypatch.setattr(codecs, "_BY_NAME", dict(codecs._BY_NAME))
    monkeypatch.setattr(codecs, "_BY_CODEC", dict(codecs._BY_CODEC))
    monkeypatch.setattr(codecs, "_DECODERS", dict(codecs._DECODERS))
    monkeypatch.setattr(sources._SOURCES, "_by_name", dict(sources._SOURCES._by_name))


class FakeDistribution:
    """A plugin distribution written into ``site`` (on ``sys.path``): its package, its
    ``*.dist-info`` and entry points; ``n`` suffixes everything it registers."""

    def __init__(self, site: Path, dist: str, entry_points: dict[str, list[str]], modules: dict[str, str],
                 version: str = "1.0") -> None:
        self.n = next(_counter)
        self.package = f"fake_plugin_{self.n}"
        self.log = site / f"{self.package}.imports"
        package = site / self.package
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        for module, source in modules.items():
            text = textwrap.dedent(source).format(n=self.n, codec_id=0xF000 + self.n)
            (package / f"{module}.py").write_text(
                f"with open({str(self.log)!r}, 'a') as _log:\n    _log.write({module!r} + '\\n')\n" + text)
        info = site / f"{dist}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{line.format(package=self.package)}\n" for line in lines) + "\n"
            for group, lines in entry_points.items()))

    def imports(self) -> list[str]:
        """The plugin's modules in the order they were imported, once per import."""
        return self.log.read_text().split() if self.log.exists() else []


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in [m for m in sys.modules if m.startswith("fake_plugin_")]:
        del sys.modules[name]


def full_plugin(site: Path, dist: str = "fake-plugin") -> FakeDistribution:
    return FakeDistribution(site, dist, {group: [f"{kind} = {{package}}.{kind}"] for kind, group in GROUP_OF.items()},
                            MODULES)


def test_each_registry_finds_an_installed_plugins_name_when_asked_for_it(site):
    plugin = full_plugin(site)
    n = plugin.n
    assert plugin.imports() == []  # nothing loads before a registry is asked

    model = models.build_model(f"fake_net_{n}", (64,), 10, seed=0)
    assert model(torch.zeros(2, 64)).shape == (2, 10)
    assert strategies.roles(f"fake_strategy_{n}") == ("worker",)
    assert codecs.create(f"fake_codec_{n}").codec_id == 0xF000 + n
    assert sources.source_named(f"fake_source_{n}").name == f"fake_source_{n}"
    assert sorted(plugin.imports()) == ["codecs", "models", "sources", "strategies"]


@pytest.mark.parametrize("kind", sorted(GROUP_OF))
def test_listing_a_registry_loads_its_group_alone(site, kind):
    plugin = full_plugin(site)
    listing = {"models": models.model_names, "strategies": strategies.names, "codecs": codecs.names,
               "sources": sources.names}[kind]
    prefix = {"models": "fake_net", "strategies": "fake_strategy", "codecs": "fake_codec",
              "sources": "fake_source"}[kind]

    assert f"{prefix}_{plugin.n}" in listing()
    assert plugin.imports() == [kind]


def test_a_group_is_loaded_once_however_often_an_unknown_name_is_asked_for(site, monkeypatch):
    plugin = full_plugin(site)
    scans: list[str] = []
    real = plugins.metadata.entry_points

    def counting(**selection):
        scans.append(selection["group"])
        return real(**selection)

    monkeypatch.setattr(plugins.metadata, "entry_points", counting)

    for _ in range(3):
        with pytest.raises(ModelConfigError, match="unknown model 'nosuch'"):
            models.build_model("nosuch", (64,), 10, seed=0)
    models.model_names()
    models.build_model("mlp", (64,), 10, seed=0)  # registered: no scan needed

    assert scans == [plugins.MODELS]
    assert plugin.imports() == ["models"]


def test_a_codec_id_from_a_peers_plugin_finds_its_decoder(site):
    plugin = full_plugin(site)

    assert codecs.name_of_codec(0xF000 + plugin.n) == f"fake_codec_{plugin.n}"


def test_a_plugin_that_fails_to_load_is_named_in_the_registrys_one_line_error(site):
    good = full_plugin(site, "good-plugin")
    broken = FakeDistribution(site, "broken-plugin", {plugins.MODELS: ["bad_net = {package}.models"]},
                              {"models": "import no_such_dependency_xyz\n"}, version="0.3")

    with pytest.raises(ModelConfigError) as caught:
        models.build_model("bad_net", (64,), 10, seed=0)

    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("unknown model 'bad_net'; registered: ")
    assert line.endswith(f"; plugin distribution broken-plugin 0.3 failed to load its entry point "
                         f"'bad_net = {broken.package}.models' (edgestream.models): importing "
                         f"{broken.package}.models raised ModuleNotFoundError: No module named "
                         "'no_such_dependency_xyz'; fix or uninstall it")
    # The working plugin of the same group still loaded, and is found.
    assert f"fake_net_{good.n}" in models.model_names()
    assert [f.distribution for f in plugins.failures(plugins.MODELS)] == ["broken-plugin 0.3"]


@pytest.mark.parametrize(("kind", "lookup", "error"), [
    ("strategies", lambda: strategies.roles("nosuch"), UnknownStrategyError),
    ("codecs", lambda: codecs.create("nosuch"), CompressorConfigError),
    ("sources", lambda: sources.source_named("nosuch"), ConfigError),
])
def test_every_registry_names_a_broken_plugin_of_its_group(site, kind, lookup, error):
    FakeDistribution(site, "broken-plugin", {GROUP_OF[kind]: ["x = {package}.broken"]},
                     {"broken": "raise RuntimeError('half-installed')\n"}, version="2.0")

    with pytest.raises(error) as caught:
        lookup()

    line = str(caught.value)
    assert "\n" not in line and "'nosuch'" in line
    assert "plugin distribution broken-plugin 2.0 failed to load its entry point 'x = fake_plugin_" in line
    assert f"({GROUP_OF[kind]}): importing " in line and "raised RuntimeError: half-installed; fix or uninstall it" in line


def test_an_entry_point_that_names_an_object_is_refused(site):
    plugin = FakeDistribution(site, "object-plugin", {plugins.MODELS: ["net = {package}.models:build"]},
                              {"models": MODULES["models"]})

    failures = plugins.load_group(plugins.MODELS)

    assert [f.line() for f in failures] == [
        f"plugin distribution object-plugin 1.0 failed to load its entry point 'net = {plugin.package}.models:build' "
        "(edgestream.models): an edgestream entry point names a module (\"package.module\"), whose @register "
        "decorators register what it adds; not an object; fix or uninstall it"]
    assert plugin.imports() == []


def test_a_plugin_registering_a_name_already_taken_fails_to_load_naming_the_clash(site):
    FakeDistribution(site, "clash-plugin", {plugins.MODELS: ["mlp = {package}.models"]},
                     {"models": "from edgestream.trainers.models import register_model\n"
                                "register_model('mlp')(lambda shape, classes: None)\n"})

    (failure,) = plugins.load_group(plugins.MODELS)

    assert "raised ModelConfigError: model 'mlp' is already registered" in failure.reason
    assert "mlp" in models.model_names()


def test_only_the_four_groups_exist():
    assert plugins.GROUPS == ("edgestream.models", "edgestream.strategies", "edgestream.codecs",
                              "edgestream.sources")
    with pytest.raises(ValueError, match="unknown entry-point group 'edgestream.nosuch'"):
        plugins.load_group("edgestream.nosuch")
