"""A run folder, written by ``train/`` and read by everything else (probe, export, studies, reports).

    runs/<name>/
        .lock              one writer at a time (``folder.RunLock``, an flock the kernel drops with the process)
        config.json        the full config, git SHA, corpus fingerprint, package versions
        metrics.jsonl      one JSON record per logged step (``metrics``)
        train.log          resumptions, warnings, how the run ended
        ckpt/step_XXXXXXX/ verified, atomic checkpoints (``checkpoint``); ckpt/latest names the newest
        probes/, export/   what ``qklab probe`` and ``qklab export`` wrote

This room knows the layout and the formats, not how a run trains: ``train/`` is one writer of it and
imports it; it imports neither ``train/`` nor ``diagnostics/``.
"""
