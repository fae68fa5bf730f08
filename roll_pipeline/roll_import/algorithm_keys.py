"""ROLL's top-level PPO keys (estimator, shaping, masks, clipping, KL) as this project's: each substitution keeps
what ROLL computes (roll/utils/functionals.py: reward_postprocess, get_sample_level_mask, compute_advantage;
roll/pipeline/rlvr/actor_worker.py: the loss)."""

from __future__ import annotations

from roll_pipeline.roll_import.report import Importer

#: ROLL's kl_penalty names -> this project's KL estimators.
KL_NAMES = {"kl": "k1", "abs": "abs", "mse": "k2"}

#: Switches that do nothing at ROLL's default and have no equivalent here when on.
OFF_BY_DEFAULT = {
    "difficulty_loss_weight": "weighting each sample's loss by its group's difficulty",
    "length_loss_weight": "weighting each sample's loss by its length",
    "balance_length": "balancing response lengths across micro-batches' losses",
    "add_len_reward": "a length term added to the reward",
    "use_reward_scaling": "ROLL's running reward scaling",
    "use_reward_norm": "ROLL's running reward normalisation",
    "whiten_rewards": "whitening the token rewards before the estimator",
    "use_topr_loss": "ROLL's TOPR loss switch (policy_loss: topr here has its own form)",
    "postive_loss_coef": "an SFT loss on positive samples",
    "use_topr_neg_loss_coef": "TOPR's negative-sample loss coefficient",
    "l2": "an L2 penalty on the weights (use training_args.weight_decay)",
    "reward_scale": "ROLL's reward scale switch",
    "reward_shift": "ROLL's reward shift switch",
    "reward_norm": "ROLL's reward_norm block (norm_mean_type / norm_std_type are read instead)",
    "use_opd": "on-policy distillation",
    "is_pure_opd": "on-policy distillation",
}


def import_algorithm(imp: Importer) -> None:
    src = imp.src
    _estimator(imp)
    imp.default("advantage_scope", "domain", "ROLL whitens and clips the advantages of each domain on its own")
    imp.move("whiten_advantages", "whiten_advantages")
    imp.move("advantage_clip", "advantage_clip")
    imp.move("reward_clip", "reward_shaping.reward_clip")
    imp.move("gamma", "gamma")
    imp.move("lambd", "lambd")
    imp.move("ppo_epochs", "ppo_epochs")
    imp.move("entropy_loss_coef", "entropy_loss_coef")
    imp.move("critic_warmup", "critic_warmup")
    if src.has("loss_agg_mode"):
        imp.move("loss_agg_mode", "loss_agg_mode")
    else:
        imp.default("loss_agg_mode", "seq-mean-token-mean", "ROLL's default; this project's is token-mean")
    _clipping(imp)
    _kl(imp)
    _masks(imp)
    for key, what in OFF_BY_DEFAULT.items():
        imp.falsy_or_refuse(key, "off, as by default", f"{what} is not built here")
    if src.has("rl_loss_coef"):
        if src.get("rl_loss_coef") == 1:
            imp.dropped("rl_loss_coef", "1, ROLL's default")
        else:
            imp.refuse("rl_loss_coef", "a factor on the whole loss: scale training_args.learning_rate instead")
    for key, default in (("use_policy_loss_type", "PPO"), ("importance_sampling", "token"), ("mask_type", "loss")):
        if src.has(key):
            if str(src.get(key)) == default:
                imp.dropped(key, f"{default}, ROLL's default and this project's")
            else:
                imp.refuse(key, f"{src.get(key)!r}: only ROLL's default ({default}) is mapped")
    for key in ("enable_reference", "enable_old_logprobs_recompute", "force_disable_old_logprobs_recompute"):
        imp.dropped(key, "the reference runs where a KL term needs it, old log-probs are computed every step")
    if src.has("train_infer_correction"):
        corr = src.get("train_infer_correction") or {}
        on = (corr.get("is_weight") or {}).get("enabled") or any(f.get("enabled") for f in corr.get("filters") or [])
        if on:
            imp.refuse("train_infer_correction", "set offpolicy_correction here (roll_core/config/offpolicy.py)")
        else:
            imp.dropped("train_infer_correction", "off")


def _estimator(imp: Importer) -> None:
    src = imp.src
    name = src.get("adv_estimator", "gae")
    if name == "grpo":
        imp.changed(
            "adv_estimator", "adv_estimator", "reinforce",
            "ROLL's grpo is its reinforce on rewards normalised by their group's mean and unbiased std (+1e-6), "
            "so: reinforce with reward_shaping norm_mean_type group, norm_std_type group",
        )
        imp.put("reward_shaping.norm_mean_type", "group")
        imp.put("reward_shaping.norm_std_type", "group")
        for key in ("norm_mean_type", "norm_std_type"):
            imp.dropped(key, "ROLL sets group for grpo whatever this says")
        return
    if name == "reinforce":
        imp.mapped("adv_estimator", "adv_estimator", "reinforce")
    elif name == "gae":
        if src.has("adv_estimator"):
            imp.mapped("adv_estimator", "adv_estimator", "gae")
        else:
            imp.default("adv_estimator", "gae", "ROLL's default estimator")
    else:
        imp.refuse("adv_estimator", f"{name!r}: ROLL's reinforce, grpo and gae are mapped, not this one")
    for key in ("norm_mean_type", "norm_std_type"):
        value = src.get(key)
        if value == "running":
            imp.changed(
                key, f"reward_shaping.{key}", "running",
                "ROLL keeps one set of running moments for all domains (running_ctrl['domain']); here each "
                "domain has its own",
            )
        elif value is None:
            imp.dropped(key, "null: no normalisation")
        else:
            imp.move(key, f"reward_shaping.{key}")


def _clipping(imp: Importer) -> None:
    src = imp.src
    pg_clip = src.get("pg_clip", 0.2)
    imp.move("pg_clip", "pg_clip")
    if src.get("use_pg_clip_range"):
        imp.dropped("use_pg_clip_range", "pg_clip_low / pg_clip_high are set instead")
        imp.move("pg_clip_low", "pg_clip_low")
        imp.move("pg_clip_high", "pg_clip_high")
    else:
        imp.dropped("use_pg_clip_range", "off: pg_clip on both sides")
        for key in ("pg_clip_low", "pg_clip_high"):
            imp.dropped(key, "read by ROLL only with use_pg_clip_range")
    if src.get("dual_clip_loss"):
        imp.changed(
            "dual_clip_loss", "dual_clip_c", round(1 + 2 * pg_clip, 12),
            f"ROLL's dual clip caps a negative advantage's loss at -(1 + 2 * pg_clip) * A, pg_clip {pg_clip}",
        )
    else:
        imp.dropped("dual_clip_loss", "off")


def _kl(imp: Importer) -> None:
    src = imp.src
    if src.get("use_kl_loss"):
        imp.mapped("use_kl_loss", "use_kl_loss", True)
        imp.move("kl_loss_coef", "kl_loss_coef")
        imp.default("kl_estimator", "k3", "ROLL's KL loss is always k3")
    else:
        imp.dropped("use_kl_loss", "off")
        imp.dropped("kl_loss_coef", "read only with use_kl_loss")
    token_keys = ("init_kl_coef", "kl_penalty", "target_kl", "kl_horizon")
    if not src.get("add_token_level_kl"):
        imp.dropped("add_token_level_kl", "off")
        for key in token_keys:
            imp.dropped(key, "read only with add_token_level_kl")
        return
    imp.mapped("add_token_level_kl", "add_token_level_kl", True)
    if src.has("init_kl_coef"):
        imp.move("init_kl_coef", "init_kl_coef")
    else:
        imp.default("init_kl_coef", 0.2, "ROLL's default")
    penalty = src.get("kl_penalty", "kl")
    if penalty in KL_NAMES:
        imp.mapped("kl_penalty", "kl_penalty", KL_NAMES[penalty], f"ROLL's {penalty!r}")
    else:
        imp.refuse("kl_penalty", f"{penalty!r}: the full-distribution KL is not built; kl, abs and mse are mapped")
    if src.get("target_kl") is not None:
        imp.mapped("target_kl", "target_kl", src.get("target_kl"))
        imp.put("kl_ctrl", "adaptive")
        imp.move("kl_horizon", "kl_horizon")
    else:
        imp.dropped("target_kl", "null: a fixed coefficient")
        imp.dropped("kl_horizon", "read only with target_kl")
    if src.get("reward_clip"):
        imp.report.changed.append((
            "reward_clip",
            "ROLL clips again after adding the token-level KL penalty; here the scores are clipped once, before it",
        ))


def _masks(imp: Importer) -> None:
    """ROLL's sample masks (get_sample_level_mask): the same masks here, per domain."""
    src = imp.src
    if src.get("max_len_mask"):
        imp.changed(
            "max_len_mask", None, None,
            "every domain gets response_filters {truncated: {}}: a response cut off at max_new_tokens leaves the "
            "loss; ROLL also masks one that ended exactly at the limit",
        )
        imp.flags["max_len_mask"] = True
    else:
        imp.dropped("max_len_mask", "off")
    thresholds = ("difficulty_low_threshold", "difficulty_high_threshold")
    if src.get("difficulty_mask"):
        low, high = (src.get(k, d) for k, d in zip(thresholds, (0.0, 1.0), strict=True))
        imp.mapped(
            "difficulty_mask", "reward_shaping.difficulty_mask", {"low": low, "high": high, "inclusive": False}
        )
        for key in thresholds:
            imp.part_of(key, "reward_shaping.difficulty_mask above; ROLL keeps a group mean strictly between")
    else:
        imp.dropped("difficulty_mask", "off")
        for key in thresholds:
            imp.dropped(key, "read only with difficulty_mask")
    if src.get("error_max_len_clip"):
        limit = src.take("error_max_len_threshold", 9999999999)
        imp.changed(
            "error_max_len_clip", "reward_shaping.length_mask", {"max_tokens": limit, "only_incorrect": True},
            "ROLL keeps a response scored exactly 1, or exactly 0 and shorter than the threshold, and masks every "
            "other score (partial credit too); here only responses not judged correct and longer are masked",
        )
    else:
        imp.dropped("error_max_len_clip", "off")
        imp.dropped("error_max_len_threshold", "read only with error_max_len_clip")
