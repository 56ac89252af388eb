"""The step wing: one optimizer step of the user's objects, the same at any world size.

``objects`` checks what the cell defined, ``trials`` runs its functions once at setup,
``cut_choice`` and ``calibration`` cut the global batch into micro-batches, ``losses`` reads
what ``loss_fn`` returns, ``weighting`` weighs each micro-batch's backward, ``precision`` wraps
it in autocast (and a scaler for fp16), ``running_stats`` keeps BatchNorm's statistics in
micro-batch order, ``optimizers`` steps several named optimizers, ``schedulers`` steps the LR
scheduler, and ``evaluation`` computes ``metric_fn``'s mean over the eval set. It stands on the
data, state and group wings, never on a state mode (it takes what it needs of one as a
Protocol).
"""
