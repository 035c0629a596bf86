"""What a run checks while it trains: validation loss (live and EMA weights), the EMA sample grid, and
FID / CLIP score every ``eval_every`` steps. Every rank takes part in each; none waits in a collective
while another works alone.

A stop signal cuts them short: each rank asks its ``stop`` between batches and between denoising
steps, and every rank leaves at the collective where the first request becomes known to all
(``sd.distributed.Stopped``), so a stopping run saves within about one batch, not one evaluation."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import torch

import sd.cli
import sd.data.buckets
import sd.distributed
import sd.evaluation
import sd.faults
import sd.runtime
import sd.sampling
import sd.train.optimizers
import sd.train.sharding
import sd.train.step
from sd.train.config import TrainConfig
from sd.train.state import Run

log = logging.getLogger("sd_train")


def due(config: TrainConfig, step: int, total: int) -> bool:
    """Whether validation or evaluation runs after optimizer step ``step`` of ``total``: every ``validate_every``
    (``eval_every``) steps and at the last step, so a run shorter than either still ends with its grid."""
    return any(every_due(every, step, total) for every in (config.validate_every, config.eval.every))


def every_due(every: int, step: int, total: int) -> bool:
    return bool(every) and (step % every == 0 or step == total)


def check(run: Run, record: dict, stop) -> tuple[Path | None, bool]:
    """This step's validation and evaluation, those due, into ``record``: ``(grid, interrupted)``.

    ``interrupted``: a stop signal (``stop()`` True on some rank) cut them short; every rank left at the
    same collective, so it is the same on all of them, and what was left undone is skipped. Any other
    error is logged as a warning and the run goes on: a setting that fails the same way on every rank
    (the config checks at start catch those they can) never costs the steps since the last save. An
    error in one rank's share (its validation batches, its grid prompts, its evaluation images) reaches
    every rank at the collective after it (``sd.distributed.Failed`` naming it), so all of them leave
    together, warn, and train on; none waits in a collective until the watchdog's timeout.
    """
    config, step, grid = run.config, run.state.step, None
    try:  # a Schedule-Free optimizer's model is its average x, not the point y it trains at (sd.train.optimizers)
        with sd.train.optimizers.evaluation_weights(run.step.optimizer):
            if every_due(config.validate_every, step, run.total_steps):
                grid = validate(run, record, stop)
            if every_due(config.eval.every, step, run.total_steps):
                record.update(evaluate(run, stop))
    except sd.distributed.Stopped:
        log.info("step %d: validation/evaluation interrupted by a stop signal; the rest of it is skipped", step)
        return grid, True
    except Exception as error:  # what it measures is worth less than the steps: training goes on, the save is kept
        log.warning("step %d: validation failed (%s: %s); training goes on without it (set validate_every: 0 or "
                    "eval.every: 0 to turn it off)", step, type(error).__name__, sd.cli.first_line(error))
        return grid, False
    return grid, False


def validate(run: Run, record: dict, stop=None) -> Path | None:
    """Validation loss with live and EMA weights, and the EMA sample grid; every rank takes part.
    ``stop``: see the module's docstring."""
    step, config = run.step, run.config
    if run.val_data is not None:
        with sd.train.sharding.unsharded(step.unet):  # fsdp: the ranks' batch counts may differ
            record["val_loss"] = sd.train.step.validation_loss(step, run.val_data, config.validation.samples,
                                                              config.batch_size, stop)
        if step.emas():
            with ema_swapped_in(step), sd.train.sharding.unsharded(step.unet):
                record["val_loss_ema"] = sd.train.step.validation_loss(step, run.val_data, config.validation.samples,
                                                                      config.batch_size, stop)
    prompts = grid_prompts(run)
    if not prompts:
        return None
    path = run.run_dir / "samples" / f"step_{run.state.step:08d}.png"
    sample_grid(run, path, prompts, stop)
    return path


def grid_prompts(run: Run) -> list[str]:
    """``validation_prompts``, then ``validation_data_captions`` captions of the training samples drawn
    with the run's seed (the same at every validation, on every rank and after a resume; a subject folder's
    instance prompt; none for a mode whose prompts take inputs of their own)."""
    config, data = run.config, run.train_data
    splits = getattr(data, "splits", None)
    if getattr(data, "instance_prompt", ""):  # a subject's folder (DreamBooth): its one prompt is its captions
        own = [data.instance_prompt] if config.validation.data_captions and not run.mode.prompt_inputs else []
        return [*config.validation_prompts, *(c for c in own if c not in config.validation_prompts)]
    count = min(config.validation.data_captions, len(data)) if splits and not run.mode.prompt_inputs else 0
    captions: list[str] = []
    if count:  # distinct captions, from up to 16 draws each: a dataset of few captions gives what it has
        rng = np.random.default_rng([config.seed, 0x67726964])  # the grid's own stream: no training draw moves
        for index in rng.choice(len(data), min(len(data), 16 * count), replace=False):
            which = int(np.searchsorted(data.offsets, index, side="right")) - 1
            split, local = splits[which], int(index - data.offsets[which])
            text = (split.captions.read(np.array([local]))[0] if split.captions is not None
                    else run.sampler.tokenizer.decode(split.input_ids[local], skip_special_tokens=True)).strip()
            if text and text not in captions and text not in config.validation_prompts:
                captions.append(text)
                if len(captions) == count:
                    break
    return [*config.validation_prompts, *captions]


@contextlib.contextmanager
def ema_swapped_in(step: sd.train.step.Step):
    """The body runs with every EMA's weights in its model (the UNet's, the text adapter's); the live
    weights come back bit for bit."""
    with contextlib.ExitStack() as stack:
        for ema, model in step.emas():
            stack.enter_context(ema.swapped_in(model))
        yield


@contextlib.contextmanager
def ema_sampling(run: Run):
    """The UNet in eval mode with the EMA weights swapped in (when there is an EMA; a text adapter's too),
    under the run's autocast; with ``sharding: fsdp`` gathered whole (the ranks sample different numbers
    of images)."""
    unet = run.step.unet
    swap = ema_swapped_in(run.step)
    unet.eval()
    try:
        with swap, sd.train.sharding.unsharded(unet), sd.runtime.autocast(run.config.precision, run.d.device):
            yield
    finally:
        unet.train()


@torch.no_grad()
def evaluate(run: Run, stop=None) -> dict:
    """``eval_fid``, ``eval_clip_score``, ``eval_n`` of the EMA weights (SD_Eval.py); every rank takes part.

    The images are those of ``SD_Eval.py --ckpt <this step's checkpoint> --prompts eval_prompts --num_prompts eval_n
    --steps validation_steps --cfg validation_cfg --sampler validation_sampler --seed seed`` at the validation size, so the logged
    numbers can be reproduced from the checkpoint. ``stop``: see the module's docstring.
    """
    with ema_sampling(run):
        try:
            scores = run.evaluation(run.sampler, run.d, stop)
        except sd.evaluation.EvalError as error:  # features that are not finite: every rank gets the same
            log.warning("step %d: no evaluation scores: %s", run.state.step, error)
            return {}
    log.info("step %d: FID %.4f%s", run.state.step, scores["eval_fid"],
             f", CLIP score {scores['eval_clip_score']:.3f}" if "eval_clip_score" in scores else "")
    return scores


@torch.no_grad()
def sample_grid(run: Run, path: Path, prompts: list[str], stop=None) -> None:
    """One image per prompt (``grid_prompts``), seed ``config.seed``, with the EMA weights: a labelled grid
    (a mode's inputs shown first in a prompt's row: a ControlNet's conditioning image).

    The prompts are shared out across the ranks, one each per round of ``sd.evaluation.gather_in_order``
    (no rank waits in a collective while another samples alone, and a stop is agreed between
    prompts), and rank 0 writes the grid. Each image is made by ``sd.sampling.generate`` at batch 1,
    the path of ``SD_ImageGen.py``: ``SD_ImageGen.py --ckpt <the checkpoint of this step> --prompt P
    --seed SEED --n 1 --steps validation_steps --cfg validation_cfg --sampler validation_sampler`` (``auto`` as ``TrainConfig.sampler`` resolves it) at the same precision draws the
    same image.
    """
    config, d = run.config, run.d
    width, height = validation_size(config, run.train_data)

    def sample(i: int) -> list:
        sd.faults.point("fail_grid", d.rank)
        inputs = run.mode.sample_inputs(i, width, height)
        images = sd.sampling.generate(run.sampler, prompts[i], "", [config.seed], steps=config.validation.steps,
                                      cfg=config.validation.cfg, sampler=config.sampler, height=height,
                                      width=width, batch_size=1, device=d.device, stop=stop, **inputs)
        return [*run.mode.shown_inputs(inputs), *images]  # a ControlNet's conditioning image before its sample

    with ema_sampling(run):
        rows = list(sd.evaluation.gather_in_order(len(prompts), sample, d, desc="validation grid", stop=stop))
    if d.is_main:
        sd.sampling.save_grid(path, list(zip(prompts, rows)))


def validation_size(config: TrainConfig, data) -> tuple[int, int]:
    """``(width, height)`` of the validation samples: the config's, else the training latents' size
    (with buckets, the one nearest square; between equals, the one with more samples)."""
    if config.validation.width:
        return config.validation.width, config.validation.height
    counts = np.bincount(data.bucket_of, minlength=len(data.shapes)) if hasattr(data, "bucket_of") else [1]
    best = min(range(len(data.shapes)),
               key=lambda i: (abs(np.log(sd.data.buckets.aspect(data.shapes[i]))), -counts[i]))
    _, h, w = data.shapes[best]
    return w * 8, h * 8
