"""Span and attribute names of inferflow's traces, in one place so that the code that emits them,
the trace viewer, the tests and ``docs/observability.md`` agree.

Span layout of one request (DESIGN.md §6)::

    "{operation} {model}"   SERVER, API process (root; continues an incoming traceparent)
    ├── <stage>             one per stage: validator, tokenizer, cache, detokenizer, ...
    └── llm_request         engine view of the request: arrival -> finish (gen_ai.latency.*)
        ├── queue           arrival -> first scheduled                    (queue time)
        └── compute         first scheduled -> finish                     (compute time)
            ├── prefill     first scheduled -> prefill end (first token)
            └── decode      prefill end -> finish

    "engine step"           one trace per engine step, span links -> the llm_request spans served
"""

from __future__ import annotations

# --- span names -------------------------------------------------------------------------------
SPAN_LLM_REQUEST = "llm_request"
SPAN_QUEUE = "queue"
SPAN_COMPUTE = "compute"
SPAN_PREFILL = "prefill"
SPAN_DECODE = "decode"
SPAN_ENGINE_STEP = "engine step"

# --- OpenTelemetry GenAI semantic conventions --------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"

# --- vLLM-style request attributes (seconds) ---------------------------------------------------
GEN_AI_REQUEST_ID = "gen_ai.request.id"
LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
LATENCY_E2E = "gen_ai.latency.e2e"

# --- general semantic conventions --------------------------------------------------------------
ERROR_TYPE = "error.type"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"

# --- inferflow-specific ------------------------------------------------------------------------
REQUEST_ID = "inferflow.request.id"
# seconds from the API process submitting the request (after its request stages) to the engine
# accepting it: the hop through LitServe's queue, kept out of queue time
SUBMIT_DELAY = "inferflow.request.submit_delay"
LORA_NAME = "inferflow.lora.name"  # the LoRA adapter a request runs with (absent: the base model)
STAGE_NAME = "inferflow.stage.name"
STAGE_CALLS = "inferflow.stage.calls"  # times a coalesced stage ran (e.g. incremental detokenizer)
STAGE_BUSY_TIME = "inferflow.stage.busy_time"  # seconds actually spent inside the stage
NUM_PREFILL_STEPS = "inferflow.request.num_prefill_steps"
NUM_DECODE_STEPS = "inferflow.request.num_decode_steps"
NUM_PREEMPTIONS = "inferflow.request.num_preemptions"
STEP_ID = "inferflow.step.id"
STEP_REQUEST_IDS = "inferflow.step.request_ids"  # traced requests, in the order of the links
STEP_BATCH_SIZE = "inferflow.step.batch_size"  # requests (rows) in the step
STEP_NUM_PREFILL_TOKENS = "inferflow.step.num_prefill_tokens"  # prompt tokens computed
STEP_NUM_DECODE_TOKENS = "inferflow.step.num_decode_tokens"  # decode rows (one token each)
STEP_NUM_BATCHED_TOKENS = "inferflow.step.num_batched_tokens"
STEP_NUM_PREFILL_REQUESTS = "inferflow.step.num_prefill_requests"
STEP_NUM_DECODE_REQUESTS = "inferflow.step.num_decode_requests"
STEP_GUIDED_ROWS = "inferflow.step.guided_rows"  # rows sampled under a structured-output mask
STEP_GUIDED_MASK_MS = "inferflow.step.guided_mask_ms"  # time to fill those masks
# speculative decoding, on engine-step spans of steps with drafts
STEP_SPEC_NUM_DRAFTS = "inferflow.spec_decode.num_drafts"  # rows that carried drafts
STEP_SPEC_NUM_DRAFT_TOKENS = "inferflow.spec_decode.num_draft_tokens"  # drafts verified
STEP_SPEC_NUM_ACCEPTED_TOKENS = "inferflow.spec_decode.num_accepted_tokens"  # of them accepted
GUIDED_COMPILE_MS = "inferflow.guided.compile_ms"  # compiling the request's grammar (0 if cached)
GUIDED_CACHE_HIT = "inferflow.guided.cache_hit"  # the compiled grammar came from the cache
GUIDED_KIND = "inferflow.guided.kind"  # json_schema | json_object | regex | choice | grammar

# --- resource attributes -----------------------------------------------------------------------
RESOURCE_MODEL_NAME = "inferflow.model.name"
RESOURCE_MODEL_VERSION = "inferflow.model.version"
RESOURCE_ENGINE_NAME = "inferflow.engine.name"
RESOURCE_ENGINE_VERSION = "inferflow.engine.version"
