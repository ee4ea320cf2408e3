"""Loading Hugging Face models and tokenizers, and turning problems into prompt tokens."""

from rlscale.models.loading import (
    load_model,
    load_tokenizer,
    pick_device,
    pick_dtype,
    resolve_model_path,
    stop_token_ids,
)
from rlscale.models.prompts import PromptRenderer

__all__ = ["load_model", "load_tokenizer", "pick_device", "pick_dtype", "resolve_model_path",
           "stop_token_ids", "PromptRenderer"]
