"""Every SGLang dotted path Tangram hooks or registers into, in one table, pinned to sglang 0.5.17.

Three tables:

``HOOKS``
    Hooks applied through SGLang's hook registry (``sglang.srt.plugins.hook_registry``). The
    plugin registers each row and, after ``HookRegistry.apply_hooks()``, verifies that the
    attribute at ``target`` really is a wrapper chain holding ``body``; start-up fails otherwise.
``REGISTRATIONS``
    Entries Tangram adds to an SGLang registry dict (attention backends, radix cache backends).
    The plugin imports ``module`` (whose import registers the entry) and verifies that ``key`` is
    in the dict at ``registry``.
``SEAMS``
    SGLang names the backend, radix and integration code call or subclass, with the parameter
    names they rely on (not hooked); ``tests/integration/test_hook_targets.py`` checks that
    each resolves with that signature on the installed sglang, so an SGLang bump that moves one
    fails a fast test instead of a server start.

To hook something new: add a ``HookTarget`` row (and its body in ``hooks.py`` or your package);
the plugin and the tests pick it up. Bump ``SGLANG_VERSION`` only after re-verifying every row.
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.17"
HOOK_TYPES = ("before", "after", "around", "replace")


@dataclass(frozen=True, slots=True)
class HookTarget:
    """One hook applied through SGLang's ``HookRegistry``.

    Attributes:
        target: dotted path of the SGLang function/method/class (``module.Class.method``).
        hook_type: one of ``HOOK_TYPES`` (SGLang's ``HookType`` values).
        body: ``"package.module:function"`` of the hook body (see ``HookRegistry.register``
            for the call signature of each type).
        purpose: why Tangram needs it (one line).
    """

    target: str
    hook_type: str
    body: str
    purpose: str


@dataclass(frozen=True, slots=True)
class Registration:
    """One entry Tangram adds to an SGLang registry dict.

    Attributes:
        registry: dotted path of the dict (e.g. ``...attention_registry.ATTENTION_BACKENDS``).
        key: the name registered (e.g. ``"tangram"``).
        module: Tangram module whose import performs the registration.
        purpose: why Tangram needs it (one line).
    """

    registry: str
    key: str
    module: str
    purpose: str


HOOKS: tuple[HookTarget, ...] = (
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler.get_init_info",
        hook_type="after",
        body="tangram_sglang.integration.hooks:add_tangram_init_info",
        purpose="put the resolved Tangram settings into scheduler_info, hence /server_info",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        hook_type="after",
        body="tangram_sglang.integration.hooks:add_tangram_pool_state",
        purpose="live pool numbers (pages, bytes held vs full KV) in /server_info",
    ),
    HookTarget(
        target="sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
        "._compute_cell_size",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_cell_size",
        purpose="size logical token slots by Tangram bytes per token (capacity gain)",
    ),
    HookTarget(
        target="sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_kv_pool",
        purpose="no full-size token K/V buffers; allocate the Tangram page pool instead",
    ),
    HookTarget(
        target="sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free",
        hook_type="before",
        body="tangram_sglang.integration.hooks:release_tangram_row",
        purpose="free a request row's pages on finish, abort and retraction",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        hook_type="around",
        body="tangram_sglang.integration.hooks:defer_tangram_finishes",
        purpose="a step's finished requests enter the radix tree after their outputs are sent",
    ),
    HookTarget(
        target="sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc",
        hook_type="after",
        body="tangram_sglang.integration.hooks:plan_tangram_rows",
        purpose="Budget Reservation: a new row's prompt tokens (what admission reserves)",
    ),
    HookTarget(
        target="sglang.srt.mem_cache.allocation.alloc_for_extend",
        hook_type="after",
        body="tangram_sglang.integration.hooks:allocate_tangram_extend",
        purpose="the scheduler allocates an extend batch's pages and advances its group lengths",
    ),
    HookTarget(
        target="sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        hook_type="after",
        body="tangram_sglang.integration.hooks:add_tangram_replay",
        purpose="a replay scorer's repeat prompt and segment copy added to each compressed row",
    ),
    HookTarget(
        target="sglang.srt.mem_cache.allocation.alloc_for_decode",
        hook_type="after",
        body="tangram_sglang.integration.hooks:allocate_tangram_decode",
        purpose="the scheduler allocates a decode step's pages (after SGLang's decode check)",
    ),
    HookTarget(
        target="sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new",
        hook_type="after",
        body="tangram_sglang.integration.hooks:record_tangram_host_batch",
        purpose="the batch's request rows from the scheduler's host copy: no GPU sync per step",
    ),
    HookTarget(
        target="sglang.srt.utils.common.support_triton",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_support_triton",
        purpose="SGLang picks Triton req_to_token writers by backend name; not on CPU",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
        hook_type="around",
        body="tangram_sglang.integration.hooks:refuse_too_large_request",
        purpose="HTTP 400 (or a lower T if max_tokens is unset) for a request the pool never fits",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_answer_refused_on_queue",
        purpose="a request that can never fit gets its HTTP 400 at once instead of a queue slot",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler.Scheduler._get_new_batch_prefill_raw",
        hook_type="after",
        body="tangram_sglang.integration.hooks:tangram_answer_refused_in_admission",
        purpose="requests admission refused (never fit) leave the queue with an HTTP 400",
    ),
    HookTarget(
        target="sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        hook_type="after",
        body="tangram_sglang.integration.hooks:tangram_check_request",
        purpose="HTTP 400 for inputs that crash SGLang's scheduler (ids, top_logprobs, grammar)",
    ),
    HookTarget(
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_add_one_req",
        purpose="admit a prefill only when its pages fit (one formula: docs/admission.md)",
    ),
    HookTarget(
        target="sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
        hook_type="after",
        body="tangram_sglang.integration.hooks:tangram_align_chunked_req",
        purpose="a continuing chunk cut short by a full token pool still ends on the grid",
    ),
    HookTarget(
        target="sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
        hook_type="around",
        body="tangram_sglang.integration.hooks:tangram_check_decode_mem",
        purpose="decode step must fit in pages; False makes SGLang retract requests",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver"
        ".get_pool_stats",
        hook_type="after",
        body="tangram_sglang.integration.metrics:tag_pool_stats",
        purpose="tag SGLang's PoolStats with the Tangram state for log lines and /metrics",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.get_prefill_usage_msg_parts",
        hook_type="after",
        body="tangram_sglang.integration.metrics:add_usage_msg_part",
        purpose="pages used/reserved and bytes vs full KV on every prefill log line",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.get_decode_usage_msg_parts",
        hook_type="after",
        body="tangram_sglang.integration.metrics:add_usage_msg_part",
        purpose="pages used/reserved and bytes vs full KV on every decode log line",
    ),
    HookTarget(
        target="sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.update_scheduler_stats",
        hook_type="after",
        body="tangram_sglang.integration.metrics:copy_to_scheduler_stats",
        purpose="carry a pool snapshot on SchedulerStats to the metrics collector",
    ),
    HookTarget(
        target="sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats",
        hook_type="after",
        body="tangram_sglang.integration.metrics:export_gauges",
        purpose="tangram:* gauges on /metrics (pages, bytes held vs full KV, fragmentation)",
    ),
)

# Added by the pieces that own them, e.g.
#   Registration("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
#                "tangram", "tangram_sglang.backend.factory", "the tangram attention backend")
#   Registration("sglang.srt.mem_cache.registry._RADIX_CACHE_REGISTRY", "tangram",
#                "tangram_sglang.radix.factory", "the tangram radix cache backend")
REGISTRATIONS: tuple[Registration, ...] = (
    Registration(
        "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
        "tangram",
        "tangram_sglang.backend.attention_backend",
        "the tangram attention backend (compressed extend, ragged decode)",
    ),
    Registration(
        "sglang.srt.mem_cache.registry._RADIX_CACHE_REGISTRY",
        "tangram",
        "tangram_sglang.radix.factory",
        "the tangram radix cache backend (compressed history reused across turns)",
    ),
)

# dotted path -> parameter names (in order; () for a non-callable: dict, list, module).
SEAMS: dict[str, tuple[str, ...]] = {
    # plugins and flags
    "sglang.srt.plugins.load_plugins": (),
    "sglang.srt.plugins.hook_registry.HookRegistry.register": (
        "target",
        "hook",
        "hook_type",
        "source",
    ),
    "sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks": (),
    "sglang.srt.server_args.prepare_server_args": ("argv",),
    "sglang.srt.server_args.ServerArgs.from_cli_args": ("args",),
    "sglang.srt.server_args.ServerArgs.get_model_config": ("self",),
    # tensor parallelism: the rank whose KV heads this process's pool holds
    "sglang.srt.runtime_context.get_parallel": (),
    "sglang.srt.runtime_context.ParallelContext.attn_tp_rank": (),
    "sglang.srt.runtime_context.ParallelContext.attn_tp_size": (),
    "sglang.srt.layers.linear.QKVParallelLinear": (),
    # attention backend
    "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS": (),
    "sglang.srt.layers.attention.attention_registry.register_attention_backend": ("name",),
    "sglang.srt.server_args.add_attention_backend_choices": ("choices",),
    "sglang.srt.server_args.ATTENTION_BACKEND_CHOICES": (),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_forward_metadata": (
        "self",
        "forward_batch",
    ),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
    ".init_forward_metadata_out_graph": ("self", "forward_batch", "in_capture"),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
    ".init_forward_metadata_in_graph": ("self", "forward_batch"),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_cuda_graph_state": (
        "self",
        "max_bs",
        "max_num_tokens",
    ),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
    ".get_cuda_graph_seq_len_fill_value": ("self",),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward_extend": (
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
        "kwargs",
    ),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward_decode": (
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
        "kwargs",
    ),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.support_triton": ("self",),
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend": ("model_runner",),
    # KV pool construction and sizing
    "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool": (
        "self",
        "memory_pool_config",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure": (
        "self",
        "pre_model_load_memory",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes": (
        "self",
        "pre_model_load_memory",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget": (
        "self",
        "budget_bytes",
        "cap_tokens",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool": (
        "self",
        "max_total_num_tokens",
        "mha_pool_class",
        "quant_method",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
    "._build_token_to_kv_pool_allocator": (
        "self",
        "sizes",
        "token_to_kv_pool",
        "is_dsv4_model",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs": (
        "self",
        "token_capacity",
    ),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size": (
        "self",
        "kvc",
        "num_layers",
    ),
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes": (
        "self",
        "available_bytes",
        "page_size",
    ),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer": (
        "self",
        "layer",
        "loc_info",
        "cache_k",
        "cache_v",
        "k_scale",
        "v_scale",
        "layer_id_override",
        "dcp_kv_mask",
    ),
    "sglang.srt.mem_cache.memory_pool.NoOpMHATokenToKVPool": (),
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc": ("self", "reqs"),
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free": ("self", "req"),
    "sglang.srt.mem_cache.allocation.alloc_for_extend": ("batch",),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend": ("self",),
    "sglang.srt.mem_cache.allocation.alloc_for_decode": ("batch", "token_per_req"),
    "sglang.srt.mem_cache.common.release_kv_cache": ("req", "tree_cache", "is_insert"),
    # admission and decode growth
    "sglang.srt.managers.schedule_policy.PrefillAdder._update_prefill_budget": (
        "self",
        "prefix_len",
        "extend_input_len",
        "max_new_tokens",
        "retracted_stain",
        "mamba_gap_reserve",
    ),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req": (
        "self",
        "req",
        "has_chunked_req",
        "truncation_align_size",
    ),
    "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req": ("self", "req"),
    "sglang.srt.managers.schedule_policy.PrefillAdder._get_running_request_total_token_offset": (
        "self",
        "req",
    ),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem": (
        "self",
        "selected_indices",
    ),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode": ("self", "server_args"),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.new_tokens_required_next_decode": (
        "self",
        "selected_indices",
    ),
    "sglang.srt.managers.scheduler.Scheduler.get_init_info": ("self",),
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state": ("self", "recv_req"),
    "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens": ("self", "req"),
    "sglang.srt.utils.common.support_triton": ("backend",),
    # prefix cache
    "sglang.srt.mem_cache.registry.register_radix_cache_backend": ("name", "factory"),
    "sglang.srt.mem_cache.registry.registered_radix_cache_backends": (),
    "sglang.srt.mem_cache.registry._RADIX_CACHE_REGISTRY": (),
    "sglang.srt.mem_cache.registry.create_tree_cache": ("ctx",),
    "sglang.srt.mem_cache.registry.default_radix_cache_factory": ("ctx",),
    "sglang.srt.mem_cache.registry.TreeCacheBuildContext": (
        "server_args",
        "params",
        "is_hybrid_swa",
        "is_hybrid_ssm",
        "enable_hierarchical_cache",
        "disable_radix_cache",
        "effective_chunked_prefill_size",
        "tp_worker",
        "model_config",
        "tp_size",
        "tp_rank",
        "tp_group",
        "full_tokens_per_layer",
        "is_dsa",
    ),
    "sglang.srt.mem_cache.cache_init_params.CacheInitParams": (),
    "sglang.srt.mem_cache.radix_cache.RadixCache": ("params",),
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": ("params",),
    "sglang.srt.mem_cache.unified_cache.component_type.ComponentType": (),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent": (
        "cache",
        "params",
    ),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent"
    ".create_match_validator": ("self", "match_device_only"),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent"
    ".redistribute_on_node_split": ("self", "new_parent", "child"),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent.evict_component": (
        "self",
        "node",
        "device_frees",
        "host_frees",
        "target",
    ),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent"
    ".acquire_component_lock": ("self", "node", "result", "lock_host"),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent"
    ".release_component_lock": ("self", "node", "params", "lock_host"),
    "sglang.srt.mem_cache.unified_cache.components.full_component.FullComponent"
    ".apply_component_action": ("self", "action"),
    "sglang.srt.mem_cache.unified_cache.tree_core_registry.register_tree_core_backend": (
        "name",
        "factory",
    ),
    "sglang.srt.mem_cache.common.evict_from_tree_cache": ("tree_cache", "num_tokens"),
    # forward batch
    "sglang.srt.model_executor.forward_batch_info.ForwardMode": (),
    "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new": (
        "batch",
        "model_runner",
        "capture_hidden_mode",
        "return_hidden_states_before_norm",
    ),
    # metrics and logs
    "sglang.srt.utils.common.add_prometheus_middleware": ("app",),
    "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats": (
        "self",
        "stats",
    ),
    "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter"
    ".report_decode_stats": ("self", "can_run_cuda_graph", "running_batch", "num_correct_drafts"),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
    ".get_decode_usage_msg_parts": ("self",),
    "sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats"
    ".get_prefill_usage_msg_parts": ("self",),
    # more of the pieces named in README.md
    "sglang.srt.server_args.ServerArgs.override": ("self", "source", "fields"),
    "sglang.srt.managers.scheduler.Scheduler.update_running_batch": ("self", "batch"),
    "sglang.srt.managers.schedule_policy.PrefillAdder.budget_state": ("self",),
    "sglang.srt.managers.schedule_batch.ScheduleBatch.release_req": (
        "self",
        "idx",
        "remaing_req_count",
        "server_args",
    ),
    "sglang.srt.model_executor.model_runner.ModelRunner._init_post_memory_pool_components": (
        "self",
    ),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_req_to_token_pool": (
        "self",
        "max_num_reqs",
    ),
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool": (
        "size",
        "max_context_len",
        "device",
        "enable_memory_saver",
    ),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.get_key_buffer": ("self", "layer_id"),
    "sglang.srt.mem_cache.memory_pool.KVWriteLoc": ("loc", "swa_loc", "full_loc"),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward_mixed": (
        "self",
        "q",
        "k",
        "v",
        "layer",
        "forward_batch",
        "save_kv_cache",
    ),
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.on_after_cuda_graph_warmup": (
        "self",
    ),
    "sglang.srt.model_executor.model_runner_components.attention_backend_setup"
    "._build_full_attention_backend_from_str": (
        "model_runner",
        "backend_str",
        "init_new_workspace",
    ),
}


def all_targets() -> list[str]:
    """Every dotted path named by the three tables (hooks, registry dicts, seams)."""
    return [h.target for h in HOOKS] + [r.registry for r in REGISTRATIONS] + list(SEAMS)
