"""BamLlama's registration with Transformers' Auto classes, done on `import bam_llama`.

Light on purpose, like the package root that runs it: every command imports the root before it parses its arguments,
so Transformers and the model are imported only inside `register` and `register_config`. The config is registered
with AutoConfig as soon as Transformers' Auto classes are imported (at once when they already are), always before they
can be used, and the models when the first BamLlamaConfig is built.
"""

import importlib.abc
import importlib.machinery
import sys

AUTO_PACKAGE = "transformers.models.auto"


_registered = False


def register() -> None:
    """Register BamLlama with AutoConfig and every Auto model class it has a model for (AutoModel,
    AutoModelForCausalLM and the task heads'; by importing modeling_bam, which imports dispatch_bam, BAM's mask
    functions too), and put each model class on the `transformers` module, where `transformers serve` looks a
    model up (`configuration_bam.expose_on_transformers`). Safe to call more than once."""
    global _registered
    if _registered:
        return
    from transformers.models import auto

    from .model.configuration_bam import BamLlamaConfig, expose_on_transformers
    from .model.modeling_bam import AUTO_CLASSES

    register_config()
    for auto_class, model_class in AUTO_CLASSES.items():
        getattr(auto, auto_class).register(BamLlamaConfig, model_class, exist_ok=True)
    expose_on_transformers({model_class.__name__: model_class for model_class in AUTO_CLASSES.values()})
    _registered = True


def register_config() -> None:
    """AutoConfig learns model_type "bam_llama". The models are registered when the first BamLlamaConfig is built
    (BamLlamaConfig.__init__ calls `register`), which every Auto model class does before it looks for the model."""
    from transformers.models.auto import AutoConfig

    from .model.configuration_bam import BamLlamaConfig

    AutoConfig.register(BamLlamaConfig.model_type, BamLlamaConfig, exist_ok=True)


class _RegisterConfigAfterAutoImport(importlib.abc.MetaPathFinder):
    """Registers the config right after `transformers.models.auto` is first imported, before anyone can use it.
    (Only the config: Transformers may import the Auto package half-way through importing what modeling_bam needs.)"""

    def find_spec(self, fullname, path, target=None):
        if fullname != AUTO_PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None  # an unusual installation: leave it to the other finders, and register on first use
        sys.meta_path.remove(self)
        spec.loader = _ThenRegisterConfig(spec.loader)
        return spec


class _ThenRegisterConfig(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        register_config()

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)


def register_now_or_on_auto_import() -> None:
    if AUTO_PACKAGE in sys.modules:
        register()
    elif not any(isinstance(finder, _RegisterConfigAfterAutoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterConfigAfterAutoImport())
