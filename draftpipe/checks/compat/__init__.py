"""The compatibility report: does an EAGLE-3 draft checkpoint fit vLLM's EAGLE-3 loader, for this verifier?

Every rule here is taken from vLLM 0.33's loader and its known pitfalls, as collected in the project's reference
on the EAGLE-3 checkpoint format (sections cited as "ref §n"):

- ``vllm/model_executor/models/llama_eagle3.py`` (``Eagle3LlamaForCausalLM``: tensor names, ``fc`` width, d2t),
  ``qwen3_eagle3.py``, ``models/registry.py`` (registered architectures), ``transformers_utils/configs/eagle.py``
  (architecture rewriting), ``transformers_utils/configs/speculators/algos.py`` (``update_eagle3``: how a
  speculators config becomes the model config), ``models/utils.py`` (``AutoWeightsLoader``: unknown names fail,
  unknown ``.bias`` names are silently ignored), ``v1/spec_decode/llm_base_proposer.py`` (embedding/lm_head sharing),
  ``v1/worker/gpu_model_runner.py`` and ``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` (where each runner reads
  the aux layer ids), ``interfaces.py`` (aux-layer convention and defaults).

Checkpoints in both formats are accepted: speculators (``speculators_config``, ``transformer_layer_config``) and
EAGLE/SpecForge (a plain Hugging Face config with ``architectures`` such as ``LlamaForCausalLMEagle3`` and
``eagle_config``; tensors ``midlayer.*``). Tensor shapes come from the safetensors header only (the first 8 bytes
give the header length, then a JSON header); only ``d2t`` and ``t2d`` (a few hundred KB at most) are read.
"""
