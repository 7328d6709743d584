"""BamLlama's registration with Transformers' Auto classes, done on `import bam_llama`; with it, Transformers' Llama
and Mistral with Scalable Softmax (`baselines/`: model types `llama_ssmax`, `mistral_ssmax`).

Light on purpose, like the package root that runs it: every command imports the root before it parses its arguments,
so Transformers and the model are imported only inside `register` and `register_config`. The config is registered
with AutoConfig as soon as Transformers' Auto classes are imported (at once when they already are), always before they
can be used, and the models when the first of the configs is built.
"""

import importlib.abc
import importlib.machinery
import sys

AUTO_PACKAGE = "transformers.models.auto"
# The configs `baselines/ssmax_configs.py` subclasses, and that module
BASE_CONFIG_MODULES = ("transformers.models.llama.configuration_llama", "transformers.models.mistral.configuration_mistral")
SSMAX_CONFIG_MODULE = f"{__package__}.baselines.ssmax_configs"


_registered = False
_ssmax_configs_registered = False


def register() -> None:
    """Register BamLlama with AutoConfig and every Auto model class it has a model for (AutoModel,
    AutoModelForCausalLM and the task heads'; by importing modeling_bam, which imports dispatch_bam, BAM's mask
    functions too), and put each model class on the `transformers` module, where `transformers serve` looks a
    model up (`configuration_bam.expose_on_transformers`). Safe to call more than once."""
    global _registered
    if _registered:
        return
    from transformers.models import auto

    from .baselines.ssmax_models import SSMAX_AUTO_CLASSES
    from .model.configuration_bam import BamLlamaConfig, expose_on_transformers
    from .model.modeling_bam import AUTO_CLASSES

    register_config()
    for auto_class, model_class in AUTO_CLASSES.items():
        getattr(auto, auto_class).register(BamLlamaConfig, model_class, exist_ok=True)
    for auto_class, model_classes in SSMAX_AUTO_CLASSES.items():
        for model_class in model_classes:
            getattr(auto, auto_class).register(model_class.config_class, model_class, exist_ok=True)
    expose_on_transformers({model_class.__name__: model_class for model_class in AUTO_CLASSES.values()})
    _registered = True


def register_config(just_imported: str | None = None) -> None:
    """AutoConfig learns model_type "bam_llama" (and "llama_ssmax", "mistral_ssmax": `register_ssmax_configs`). The
    models are registered when the first of these configs is built (its `__init__` calls `register`), which every
    Auto model class does before it looks for the model."""
    from transformers.models.auto import AutoConfig

    from .model.configuration_bam import BamLlamaConfig

    AutoConfig.register(BamLlamaConfig.model_type, BamLlamaConfig, exist_ok=True)
    register_ssmax_configs(just_imported)


def register_ssmax_configs(just_imported: str | None = None) -> None:
    """AutoConfig learns "llama_ssmax" and "mistral_ssmax". They subclass Transformers' Llama and Mistral configs,
    whose modules import the Auto package half-way through their own import: while one of them (or ours) is
    half-imported this waits, and the end of that import calls it again (`_RegisterConfigAfterImports`, naming the
    module `just_imported`, which importlib still marks as importing)."""
    global _ssmax_configs_registered
    waiting_for = [name for name in (*BASE_CONFIG_MODULES, SSMAX_CONFIG_MODULE) if name != just_imported]
    if _ssmax_configs_registered or any(_half_imported(name) for name in waiting_for):
        return
    from transformers.models.auto import AutoConfig

    from .baselines.ssmax_configs import SSMAX_CONFIGS

    for config_class in SSMAX_CONFIGS:
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    _ssmax_configs_registered = True
    for finder in [finder for finder in sys.meta_path if isinstance(finder, _RegisterConfigAfterImports)]:
        sys.meta_path.remove(finder)  # nothing left to wait for


def _half_imported(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False)


class _RegisterConfigAfterImports(importlib.abc.MetaPathFinder):
    """Registers the configs right after `transformers.models.auto` is first imported, before anyone can use it, and
    again after Llama's or Mistral's config module (`register_ssmax_configs`). (Only the configs: Transformers may
    import the Auto package half-way through importing what the models need.)"""

    def find_spec(self, fullname, path, target=None):
        if fullname not in (AUTO_PACKAGE, *BASE_CONFIG_MODULES):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # an unusual installation: leave it to the other finders, and register on first use
        spec.loader = _ThenRegisterConfig(spec.loader)
        return spec


class _ThenRegisterConfig(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        if module.__name__ == AUTO_PACKAGE or (AUTO_PACKAGE in sys.modules and not _half_imported(AUTO_PACKAGE)):
            register_config(module.__name__)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)


def register_now_or_on_auto_import() -> None:
    if AUTO_PACKAGE in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterConfigAfterImports) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterConfigAfterImports())
