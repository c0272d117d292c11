"""Text layer of the OpenAI-compatible gateway: tokenizer, chat templates, stream
detokenizer, stop strings.

The gateway process must stay free of torch, so this package only uses the ``tokenizers``
library (``tokenizer.json``) and ``jinja2``. The behaviour follows Hugging Face
``transformers``' fast tokenizers for the same files (which the tests check byte for byte):

- ``tokenizer``: :class:`Tokenizer` loads a model directory's tokenizer files (or the same files
  received over HTTP, see :data:`TOKENIZER_FILES`) and offers ``encode``/``decode``/
  ``apply_chat_template``/``chat_ids``.
- ``chat_template``: :class:`ChatTemplate`, the sandboxed rendering of a model's chat template.
- ``detokenizer``: :class:`IncrementalDetokenizer` turns a stream of token ids into a stream of
  text whose concatenation equals ``Tokenizer.decode`` of all the ids, never emitting half a
  character.
- ``cleanup``: transformers' ``clean_up_tokenization``, whole or streamed.
- ``stop_strings``: :class:`StopStringMatcher` cuts a text stream exactly before the first stop
  string.
"""

from gateway.text.chat_template import ChatTemplate, ChatTemplateError
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.stop_strings import StopStringMatcher
from gateway.text.tokenizer import TOKENIZER_FILES, Tokenizer

__all__ = [
    "TOKENIZER_FILES",
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "Tokenizer",
]
