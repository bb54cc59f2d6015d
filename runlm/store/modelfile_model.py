"""Models made from a Modelfile (``runlm create NAME -f Modelfile``, Ollama's ``/api/create``): a stored model's
files under a new name, with defaults of its own that follow it everywhere it is served.

The new ref lists the base model's files (no weight is copied) and, as blobs of their own, the TEMPLATE
(``modelfile/template``: Jinja, or Ollama's Go, told apart by runlm/formats/go_template.looks_like_go), the
SYSTEM prompt and MESSAGE history (``modelfile/defaults.json``, with PARAMETER stop) and the ADAPTER's files
(``modelfile/adapter/``: applied to every request for the model). Its ``info`` carries the
template and the PARAMETER sampling settings over the base's, so ``show`` and ``/api/show`` see them; the
manifest's ``modelfile`` entry keeps what the Modelfile said (``runlm show --modelfile`` writes it back out) and
its num_ctx, the context the daemon loads it with unless asked for another. ADAPTER is refused, not dropped.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runlm.formats.modelfile import PEFT_FILES, ROLES, ChatDefaults, Modelfile, is_adapter
from runlm.formats.sampling_defaults import MIN_CONTEXT, OLLAMA_FIXED, OLLAMA_NAMES, checked
from runlm.store.metadata import ModelInfo
from runlm.store.names import ModelName
from runlm.store.progress import ProgressCallback, PullProgress
from runlm.store.refs import StoredModel, model_manifest
from runlm.store.store import ModelStore

TEMPLATE_FILE = "modelfile/template"
DEFAULTS_FILE = "modelfile/defaults.json"
ADAPTER_DIR = "modelfile/adapter/"
ADAPTER_TYPE = "application/vnd.ollama.image.adapter"
OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"
DEFAULTS_TYPE = "application/vnd.runlm.model.defaults+json"
MAX_STOPS = 16
MAX_TEXT = 1 << 20            # a TEMPLATE, SYSTEM or MESSAGE (and all MESSAGEs together)
MAX_MESSAGES = 1024
_NO_INFO = ModelInfo(format="", architecture="", parameters=0, quantization="", context_length=0)


class ModelSpecError(ValueError):
    """A Modelfile (or /api/create body) that cannot make a model; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ModelSpec:
    """What a new model changes over its base (Ollama's /api/create fields; PARAMETER names are Ollama's)."""
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    adapters: dict[str, str] = field(default_factory=dict)  # file name -> blob digest (already in the store)


def check_parameters(parameters: dict[str, Any]) -> tuple[dict[str, float | int], list[str], int | None]:
    """PARAMETERs as (sampling settings in SamplingParams' names, stop strings, num_ctx); a ModelSpecError names
    any runlm cannot honour."""
    sampling_in, stops, num_ctx = {}, [], None
    for key, value in parameters.items():
        where = f"parameters.{key}"
        if key == "stop":
            values = value if isinstance(value, list) else [value]
            if len(values) > MAX_STOPS or not all(isinstance(v, str) and 0 < len(v) <= 256 for v in values):
                raise ModelSpecError(f"PARAMETER stop: at most {MAX_STOPS} strings of 1 to 256 characters", where)
            stops += values
        elif key == "num_ctx":
            if isinstance(value, bool) or not isinstance(value, int) or value < MIN_CONTEXT:
                raise ModelSpecError(f"PARAMETER num_ctx must be an integer of at least {MIN_CONTEXT}", where)
            num_ctx = value
        elif key in OLLAMA_FIXED:  # accepted at one value only (what runlm does), as Ollama's options are
            want, why = OLLAMA_FIXED[key]
            if value != want:
                raise ModelSpecError(f"PARAMETER {key} {value} is not supported (only {want}: {why})", where)
        elif key in OLLAMA_NAMES:
            sampling_in[key] = value
        else:
            raise ModelSpecError(f"PARAMETER {key} is not one runlm has: use one of "
                                 f"{', '.join(sorted([*OLLAMA_NAMES, 'stop', 'num_ctx']))}", where)
    sampling = checked(sampling_in, OLLAMA_NAMES)
    names = {f: n for n, f in OLLAMA_NAMES.items()}
    if bad := sorted(set(sampling_in) - {names[f] for f in sampling}):
        raise ModelSpecError(f"PARAMETER {bad[0]} {sampling_in[bad[0]]!r} is not a number in its range",
                             f"parameters.{bad[0]}")
    return sampling, stops, num_ctx


def _check_text(value: Any, what: str, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ModelSpecError(f"{what} must be a string of at most {MAX_TEXT} characters", param)
    return value


def _plain_name(file_name: str) -> bool:
    """A file's own name, not hidden and without a folder in it (what a store path may take from a client)."""
    return bool(file_name) and Path(file_name).name == file_name and not file_name.startswith(".")


def check_spec(spec: ModelSpec) -> None:
    from runlm.formats.template_render import template_problem

    if spec.adapters and not is_adapter(set(spec.adapters)):
        raise ModelSpecError(f"adapters: one LoRA adapter, its files {' and '.join(PEFT_FILES)} or one .gguf file",
                             "adapters")
    for file_name in spec.adapters:
        if not _plain_name(file_name):
            raise ModelSpecError(f"adapters: {file_name!r} is not a plain file name", "adapters")

    template = _check_text(spec.template, "TEMPLATE", "template")
    if template and (why := template_problem(template, MAX_TEXT)):
        raise ModelSpecError(f"TEMPLATE {why}", "template")
    _check_text(spec.system, "SYSTEM", "system")
    if len(spec.messages) > MAX_MESSAGES or sum(len(str(m.get("content", ""))) for m in spec.messages) > MAX_TEXT:
        raise ModelSpecError(f"at most {MAX_MESSAGES} MESSAGEs of {MAX_TEXT} characters in all", "messages")
    for i, m in enumerate(spec.messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ModelSpecError(f"messages[{i}]: a message is {{role: {'|'.join(ROLES)}, content: string}}",
                                 f"messages[{i}]")
    for text in spec.license:
        _check_text(text, "LICENSE", "license")
    check_parameters(spec.parameters)


def create_model(store: ModelStore, name: str, base: StoredModel, spec: ModelSpec) -> StoredModel:
    """Store ``name`` as ``base`` with ``spec``'s changes (a ModelSpecError for a bad spec)."""
    check_spec(spec)
    old = base.manifest.get("modelfile") or {}
    files = [f for f in base.manifest["files"] if not f["path"].startswith("modelfile/")]
    info = ModelInfo.from_json(dict(base.manifest["info"]))
    template = spec.template if spec.template is not None else old.get("template")
    system = spec.system if spec.system is not None else old.get("system")
    messages = spec.messages or list(old.get("messages") or [])
    parameters = {**(old.get("parameters") or {}), **spec.parameters}
    sampling, stops, num_ctx = check_parameters(parameters)  # the base's own Modelfile settings under this one's
    with store.adding():
        if template is not None:
            info.template = template
            digest, size = store.blobs.put_bytes(template.encode())
            files.append({"path": TEMPLATE_FILE, "digest": digest, "size": size, "media_type": OLLAMA_TEMPLATE})
        if system or messages or stops:
            data = json.dumps({"system": system, "messages": messages, "stop": stops}).encode()
            digest, size = store.blobs.put_bytes(data)
            files.append({"path": DEFAULTS_FILE, "digest": digest, "size": size, "media_type": DEFAULTS_TYPE})
        adapters = spec.adapters or dict(old.get("adapters") or {})
        if adapters and base.info.format not in ("gguf", "safetensors"):
            raise ModelSpecError(f"a LoRA adapter goes on a GGUF or safetensors model, not {base.info.format}",
                                 "adapters")
        for file_name, digest in adapters.items():
            if not store.blobs.has(digest):
                raise ModelSpecError(f"adapters: {file_name}: no blob {digest} (upload it first)", "adapters")
            files.append({"path": ADAPTER_DIR + file_name, "digest": digest,
                          "size": store.blobs.path(digest).stat().st_size, "media_type": ADAPTER_TYPE})
        info.sampling = {**info.sampling, **sampling}
        entry = {"from": old.get("from") or str(base.name), "parameters": parameters, "template": template,
                 "system": system, "messages": messages, "license": [*(old.get("license") or []), *spec.license],
                 "num_ctx": num_ctx, "adapters": adapters}
        identity = "modelfile:" + hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()
        manifest = model_manifest(files, base.manifest["layout"], info,
                                  {"kind": "modelfile", "location": entry["from"], "identity": identity},
                                  modelfile=entry, **({"oci": base.manifest["oci"]} if "oci" in base.manifest and
                                                      files == base.manifest["files"] else {}))
        return store.write_ref(name, manifest)


def chat_defaults(model: StoredModel) -> ChatDefaults | None:
    """The SYSTEM prompt, MESSAGEs and stop strings of a model made from a Modelfile, from its manifest (what its
    defaults file holds for an engine in another process); None for a model without them."""
    entry = model.manifest.get("modelfile") or {}
    stop = (entry.get("parameters") or {}).get("stop") or []
    if not (entry.get("system") or entry.get("messages") or stop):
        return None
    return ChatDefaults(entry.get("system"), tuple(entry.get("messages") or ()), tuple(stop))


def chat_settings(model: StoredModel, model_path: Path) -> tuple[str | None, ChatDefaults | None, Path | None]:
    """The template, chat defaults and LoRA adapter a model made from a Modelfile brings (None for any other):
    what a process that loads it itself (``runlm run`` without a daemon) runs it with."""
    template, _, adapter = model_files(model, model_path)
    return (model.info.template if template else None), chat_defaults(model), adapter


def model_files(model: StoredModel, model_path: Path) -> tuple[Path | None, Path | None, Path | None]:
    """A stored model's TEMPLATE file, defaults file and LoRA adapter (a PEFT folder or a .gguf file), beside
    ``model_path``, the store's view of it; None for what it does not have."""
    base = model_path.parent if model.manifest["layout"] == "file" else model_path
    paths = {f["path"] for f in model.manifest["files"]}
    adapter = sorted(p.removeprefix(ADAPTER_DIR) for p in paths if p.startswith(ADAPTER_DIR))
    where = None if not adapter else base / ADAPTER_DIR / adapter[0] if adapter[0].endswith(".gguf") \
        else base / ADAPTER_DIR
    return (base / TEMPLATE_FILE if TEMPLATE_FILE in paths else None,
            base / DEFAULTS_FILE if DEFAULTS_FILE in paths else None, where)


def parameters_of(model: StoredModel) -> dict[str, Any]:
    """A model's settings in Ollama's names: its recommended sampling settings, and the stop strings and num_ctx
    its Modelfile gave."""
    from runlm.formats.sampling_defaults import to_ollama

    given = (model.manifest.get("modelfile") or {}).get("parameters") or {}
    return {**to_ollama(model.info.sampling), **{k: v for k, v in given.items() if k in ("stop", "num_ctx")}}


def show_modelfile(model: StoredModel) -> str:
    """``ollama show --modelfile``: the Modelfile that makes this model again (FROM its base for a model made from
    one; its recommended settings as PARAMETERs; its template, system prompt, messages and license)."""
    from runlm.formats.modelfile import modelfile_text

    entry = model.manifest.get("modelfile") or {}
    return modelfile_text(entry.get("from") or str(model.name), parameters_of(model), model.info.template,
                          entry.get("system"), entry.get("messages"), entry.get("license"))


def spec_from_modelfile(modelfile: Modelfile, adapter_digests: dict[str, str]) -> ModelSpec:
    """A parsed Modelfile as a ModelSpec (``adapter_digests``: its ADAPTER files' blobs, file name -> digest)."""
    return ModelSpec(template=modelfile.template, system=modelfile.system, parameters=dict(modelfile.parameters),
                     messages=list(modelfile.messages), license=list(modelfile.license), adapters=adapter_digests)


def create_from_modelfile(store: ModelStore, name: str, modelfile: Modelfile, folder: Path,
                          quantize: str | None = None, progress: ProgressCallback | None = None) -> StoredModel:
    """``runlm create NAME -f Modelfile``: FROM a stored model's name, or a GGUF file or model folder (relative to
    the Modelfile's ``folder``: imported first); ``quantize``: the base quantized
    (a GGUF F16/BF16/F32 model or a safetensors one) before the Modelfile's settings go on it."""
    assert modelfile.base is not None
    path = (folder / modelfile.base).expanduser()
    local = path.exists() and (modelfile.base.startswith((".", "/", "~")) or "/" in modelfile.base.strip("/")
                               or path.suffix == ".gguf")
    if len(modelfile.adapters) > 1:
        raise ModelSpecError("one ADAPTER per Modelfile (merge several into one first)", "adapters")
    adapters: dict[str, str] = {}
    for entry in modelfile.adapters:
        given = (folder / entry).expanduser()
        files = [given / f for f in PEFT_FILES] if given.is_dir() else [given]
        if not all(f.is_file() for f in files) or not is_adapter({f.name for f in files}):
            raise ModelSpecError(f"ADAPTER {entry}: a LoRA adapter is a PEFT folder ({' and '.join(PEFT_FILES)}) or "
                                 f"a .gguf file", "adapters")
        with store.adding():
            adapters = {f.name: store.blobs.put_file(f)[0] for f in files}
    spec = spec_from_modelfile(modelfile, adapters)
    check_spec(spec)  # before anything is imported or quantized
    base = store.pull(str(path), name, progress=progress) if local else store.ensure(modelfile.base, progress)
    return build_model(store, name, base, spec, quantize, progress)


def build_model(store: ModelStore, name: str, base: StoredModel, spec: ModelSpec, quantize: str | None = None,
                progress: ProgressCallback | None = None) -> StoredModel:
    """``base``, quantized first where ``quantize`` names a type (a GGUF F16/BF16/F32 model or a safetensors one),
    stored as ``name`` with ``spec``'s changes: what ``runlm create`` and ``/api/create`` both make."""
    if quantize is not None:
        from runlm.store.quantized import quantize_into_store, source_file

        file = source_file(store, str(base.name), local_files=False)  # a GGUF file or a safetensors folder
        base = store.get(quantize_into_store(store, file, name, quantize, progress=progress)[1])
    if progress is not None:
        progress(PullProgress("writing manifest"))
    return create_model(store, name, base, spec)


def model_from_blobs(store: ModelStore, name: str, files: dict[str, str]) -> StoredModel:
    """A model made of uploaded blobs (Ollama's ``files``: file name -> digest): one GGUF file, or a safetensors
    folder's files. Only a ref is written (its files are blobs already); a ModelSpecError names what is wrong."""
    from runlm.formats import ModelFormatError
    from runlm.store.inspect import inspect_model
    from runlm.store.refs import SINGLE_FILE_NAME

    entries: list[dict[str, Any]] = []
    for file_name, digest in files.items():
        if not _plain_name(file_name):
            raise ModelSpecError(f"files: {file_name!r} is not a plain file name", "files")
        if not store.blobs.has(digest):
            raise ModelSpecError(f"files: {file_name}: no blob {digest} (upload it first)", "files")
        entries.append({"path": file_name, "digest": digest, "size": store.blobs.path(digest).stat().st_size})
    ggufs = [e for e in entries if e["path"].endswith(".gguf")]
    if len(entries) == 1 and ggufs:
        layout, entries = "file", [{**entries[0], "path": SINGLE_FILE_NAME}]
    elif ggufs:
        raise ModelSpecError("files: one GGUF file, or the files of one safetensors model folder", "files")
    else:
        layout = "dir"
    placeholder = StoredModel(ModelName.parse(name), {"id": model_manifest(entries, layout, _NO_INFO, {})["id"],
                                                      "files": entries, "layout": layout})
    try:
        info = inspect_model(store.model_path(placeholder))
    except ModelFormatError as exc:
        raise ModelSpecError(f"files: {exc}", "files") from None
    with store.adding():
        manifest = model_manifest(entries, layout, info, {"kind": "files", "location": name,
                                                          "identity": "files:" + placeholder.id})
        return store.write_ref(name, manifest)
