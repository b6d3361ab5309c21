"""The Execute stream around the step loop: requests read ahead, outputs written beside, the stall watch, per-request spans, the profiler."""
