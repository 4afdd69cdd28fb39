"""``LLM``: generate text for a list of prompts in one call (lesson 08, vLLM's offline API)."""
from __future__ import annotations

import contextlib
import importlib

import torch
from tqdm.auto import tqdm

from minipaged.engine.llm_engine import LLMEngine
from minipaged.outputs import RequestOutput
from minipaged.sampling_params import SamplingParams
from minipaged.validation import as_token_ids


class LLM:
    """A model with a paged KV cache and a continuous-batching engine.

    ``LLM()`` loads the embedded SmolLM2-135M-Instruct. Every setting of the engine is accepted
    (``num_gpu_blocks``, ``kv_cache_bytes``, ``gpu_memory_utilization``, ``tensor_parallel_size``
    for N worker processes (lesson 14), ...): the fields of ``EngineConfig``
    (``minipaged/config.py``), which hold their defaults and meanings.
    Prefix caching is on by default: prompts that start like earlier ones reuse their cached KV
    blocks (lesson 11); ``enable_prefix_caching=False`` turns it off.

    ``LLM(learner=True)`` is the learner's engine (lesson 16), as ``minipaged serve --learner``
    builds it: the package's engine with every component the learner saved plugged in during
    each call, ``learner_report`` naming each part still the package's. A learner's component
    that raises is named in the error (``LearnerComponentError``), whose ``outputs`` keep the
    requests of that call that had finished (None for the others, which are aborted).

    Args:
        model: a Hugging Face id, a local ``save_pretrained`` directory, or None for the
            embedded model.
        learner: build the engine from the learner's saved components.
        settings: engine settings by name; an unknown name raises TypeError.
    """

    def __init__(self, model: str | None = None, *, learner: bool = False, **settings) -> None:
        if not isinstance(learner, bool):
            raise TypeError(f"learner must be True or False, got {learner!r}")
        self.learner_report: str | None = None
        self._learner = None  # (exercises/served_learner.py, the learner's components)
        if learner:
            # NOTE: found by name: the build track (exercises/) sits above the entrypoints
            # (docs/ARCHITECTURE.md)
            served = importlib.import_module(LEARNER_MODULE)
            found, self.learner_report = served.learner_parts()
            self._learner = (served, found)
            print(f"minipaged: {self.learner_report}", flush=True)
        with self._plugged():
            self.llm_engine = LLMEngine(model, **settings)

    def _plugged(self):
        """The learner's components in the engine for the block (``learner=True``)."""
        if self._learner is None:
            return contextlib.nullcontext()
        served, found = self._learner
        return served.plugged(found)

    def shutdown(self) -> None:
        """Give the engine's memory back now (model, KV pools, CUDA graphs, worker processes;
        on CUDA torch's cached blocks too). ``generate`` then raises; a second call does nothing.
        ``with LLM(...) as llm:`` calls it at the end of the block, ``del llm`` at collection."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def serve_in_background(self, served_model_name: str = "minipaged"):
        """Serve this engine from threads of its own (notebooks): the OpenAI API and the live
        page at the returned ``BackgroundServer``'s ``url``, until its ``stop()``. With
        ``learner=True`` the learner's components stay plugged in until then; while it serves,
        talk to the server, not to ``generate``."""
        from minipaged.engine.async_llm_engine import AsyncLLMEngine
        from minipaged.entrypoints.api_server import BackgroundServer, build_app

        plugged = self._plugged()
        plugged.__enter__()
        try:
            return BackgroundServer(build_app(AsyncLLMEngine(self.llm_engine), served_model_name),
                                    on_stop=lambda: plugged.__exit__(None, None, None))
        except BaseException:
            plugged.__exit__(None, None, None)
            raise

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``LLMEngine.reset_prefix_cache``): the next prompts are
        computed in full."""
        return self.llm_engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[int] | list[list[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions; returns one RequestOutput per prompt, in input order.

        Every prompt is checked before any is queued, so a bad prompt raises ValueError and
        nothing else of this call has started.
        """
        with self._plugged():
            return self._generate(prompts, sampling_params, prompt_token_ids, use_tqdm)

    def _generate(self, prompts, sampling_params, prompt_token_ids, use_tqdm):
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompts is not None and not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string or a list of strings, got "
                             f"{type(prompts).__name__}")
        if prompt_token_ids is not None:
            prompt_token_ids = _token_id_lists(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None \
                and len(prompts) != len(prompt_token_ids):
            raise ValueError(f"got {len(prompts)} prompts but {len(prompt_token_ids)} "
                             f"prompt_token_ids lists")
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * num)
        if len(params) != num:
            raise ValueError(f"got {len(params)} sampling_params for {num} prompts")

        engine = self.llm_engine
        requests = []
        # NOTE: every prompt is checked before the first is queued, so that a bad one anywhere
        # leaves the engine exactly as it was.
        for i in range(num):
            text = prompts[i] if prompts is not None else None
            try:
                if prompt_token_ids is not None:
                    ids = as_token_ids(prompt_token_ids[i])
                else:
                    if not isinstance(text, str):
                        raise ValueError(f"prompts[{i}] must be a string, got "
                                         f"{type(text).__name__}")
                    ids = engine.encode(text)
                engine.validate_request(ids, params[i])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            requests.append((text, ids, params[i]))

        request_ids = []
        try:
            for text, ids, p in requests:
                request_ids.append(engine.add_request(None, text, p, ids))
        except BaseException:
            for request_id in request_ids:  # (cannot happen after validation; stay clean)
                engine.abort_request(request_id)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies to conversations, formatted by the tokenizer's chat template.

        ``messages`` is one conversation (a list of {"role", "content"} dicts) or a list of them.
        """
        tokenizer = self.get_tokenizer()
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        texts, ids = [], []
        for conversation in messages:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=False)
            texts.append(text)
            ids.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(texts, sampling_params, prompt_token_ids=ids, use_tqdm=use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        # NOTE: the worker picks torch's threads per step (worker/cpu_threads.py); the caller's
        # own count is theirs again when generate returns.
        threads = torch.get_num_threads()
        try:
            while len(done) < len(wanted):
                for output in engine.step():
                    if output.finished and output.request_id in wanted \
                            and output.request_id not in done:
                        done[output.request_id] = output
                        bar.update(1)
        except BaseException as error:
            for request_id in wanted - set(done):  # leave the engine clean for the next call
                with contextlib.suppress(Exception):  # (a learner's scheduler may raise again)
                    engine.abort_request(request_id)
            if self._learner is not None and isinstance(error,
                                                        self._learner[0].LearnerComponentError):
                error.outputs = [done.get(r) for r in request_ids]
                error.add_note(f"{len(done)} of {len(request_ids)} requests had finished "
                               f"before it: their outputs are in this error's .outputs")
            raise
        finally:
            bar.close()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        return [done[r] for r in request_ids]


LEARNER_MODULE = "minipaged.exercises.served_learner"


def _token_id_lists(prompt_token_ids) -> list:
    """One prompt's ids, or a list of them (lists, numpy arrays or torch tensors), as a list."""
    if hasattr(prompt_token_ids, "ndim") and hasattr(prompt_token_ids, "tolist"):
        if prompt_token_ids.ndim == 1:
            return [prompt_token_ids]
        if prompt_token_ids.ndim == 2:
            return list(prompt_token_ids)
        raise ValueError(f"prompt_token_ids must be 1-D (one prompt) or 2-D (several), got "
                         f"shape {tuple(prompt_token_ids.shape)}")
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of token ids or a list of such "
                         f"lists, got {type(prompt_token_ids).__name__}")
    if prompt_token_ids and not isinstance(prompt_token_ids[0], (list, tuple)) \
            and not hasattr(prompt_token_ids[0], "ndim"):
        return [prompt_token_ids]  # one prompt
    return list(prompt_token_ids)
