"""Plumbing shared by the scripts, in layers: launch/ (flags, launch checks), data/ (data in), run/ (the training
run), report/ (what a run reports), predict/ (scripts/predict.py) and benchmark/ (the benchmark and its baselines);
models.py and metrics/ (what is trained and measured); errors.py, files.py and output_files.py (their names) below all.

The scripts decide how processes talk to each other; the helpers here only say what they do.
A few of them are collective: every process must call them, at the same point of the run, or the
run hangs until --ddp_timeout (a call on the main process only is the classic mistake). They are
listed in COLLECTIVE_HELPERS, and the scripts mark every call of one with `# [collective]`
(tests/test_accelerate_markers.py checks both the list and the marks). Everything else is local to
the process that calls it. The scripts put the repository root on sys.path, so `utils` works from a
plain clone.
"""

COLLECTIVE_HELPERS = (
    "fit_batch_size",  # run/batch_size.py: gathers every process's largest fitting batch
    "gather_running_loss",  # run/steps.py: gathers the losses
    "save_checkpoint",  # run/checkpoints.py: barriers around save_state, then all learn whether every process wrote
    "stop_if_any_failed",  # run/checkpoints.py: save_checkpoint's check that every process wrote its files
    "load_checkpoint",  # run/resume.py: load_state (under FSDP: the shards)
    "save_if_best",  # run/best.py: save_checkpoint of the plain weights
    "epochs_to_train",  # run/resume.py: check_trigger per epoch (--early_stopping_patience)
    "after_step",  # run/steps.py: gathers the losses (--logging_steps), evaluates (--eval_steps)
    "at_epoch_end",  # run/steps.py: the evaluation due, save_if_best
    "stop_requested",  # run/signals.py: check_trigger per step (--save_on_signal)
    "report_run",  # report/results.py: gathers one row per process
    "replica_fingerprints",  # run/fingerprints.py: gathers every process's fingerprints of a model
    "evaluate_model_ema",  # run/ema.py: broadcasts the average's buffers, then the evaluation (gather_for_metrics)
    "save_model_ema",  # run/ema.py: gathers every process's fingerprints of the average
    "epoch_batches",  # data/streaming.py: a stream's batches_every_process_has
    "batches_every_process_has",  # data/streaming.py: gathers every process's "I have a whole accumulation cycle"
    # hooks that torch calls (the scripts never do), each broadcasting rank 0's buffers, collective: run/fsdp.py's
    # keep_rank_0_buffers (FSDP: before the first evaluation forward after training and before each state_dict()) and
    # run/deepspeed.py's buffers_as_under_ddp (DeepSpeed: before every forward)
    "broadcast_from_rank_0",
    "before_forward",
)
