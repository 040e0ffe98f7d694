"""The names of the files our scripts write, in one place: a run's --output_dir, its checkpoints and best/, a sweep's
trial folders (docs/output_files.md says what each holds and when it is written)."""

# In OUTPUT_DIR
WEIGHTS = "model.safetensors"  # the trained weights (save_model); also in best/
EMA_WEIGHTS = "model_ema.safetensors"  # --model_ema's average, at the end of a training run
RUN_RECORD = "run.json"  # what defines a run; in OUTPUT_DIR and in each of its checkpoints (save_checkpoint)
RESULTS = "results.json"  # what a finished training run reports, written last
EVAL_RESULTS = "eval_results.json"  # --eval_only's; results.json stays the training run's
LOCK = "run.lock"  # empty while no training holds it; "pid P on HOST since TIME" while one does
BEST = "best"  # --metric_for_best: OUTPUT_DIR/best holds the best epoch's model.safetensors and training state

# In every checkpoint (OUTPUT_DIR/epoch_N, step_N, best/)
TRAINING_STATE = "training_state.json"  # the run's progress (utils/run/progress.py TrainingProgress)
MANIFEST = "manifest.json"  # {"files": {relative path: {"size", "sha256"}}} of every other file, written last
# Accelerate's name for the first (here the only) object registered for checkpointing: --model_ema's average
EMA_CHECKPOINT_FILE = "custom_checkpoint_0.pkl"

# In each trial's folder of scripts/sweep.py
TRIAL_RECORD = "sweep_trial.json"  # {"command": ..., "exit_code": ...}
LAUNCH_LOG = "launch.log"  # the launch's whole output
