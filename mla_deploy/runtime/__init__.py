"""The deployable runtime: onnxruntime + numpy (+ tokenizers for text). Never imports torch.

    from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
    model = ExportedModel("out/")
    result = Generator(model, SamplingParams(temperature=0.7, top_p=0.9, seed=0)).generate([[1, 2, 3]], 32)
"""

from .generator import GenerationResult, Generator, StepOutput
from .sampling import SamplingParams
from .session import ExportedModel, RuntimeOptions
from .text import TextStream, Tokenizer

__all__ = ["ExportedModel", "GenerationResult", "Generator", "RuntimeOptions", "SamplingParams", "StepOutput",
           "TextStream", "Tokenizer"]
