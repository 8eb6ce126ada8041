"""The rich model summary without Lightning's FLOPs column, which reads 0 for every module (it counts only
with an ``example_input_array``); :class:`~lwm.callbacks.flops.FlopCounter` measures the real step's FLOPs
on the first batch and prints them. Also leaves out the validation metrics' rows (no parameters)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

from lwm.utils.errors import ConfigError

HIDDEN_COLUMNS = ("FLOPs",)
HIDDEN_PREFIXES = ("val_metrics",)


class ModelSummary(RichModelSummary):
    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if max_depth < -1:
            raise ConfigError(f"model_summary.max_depth must be -1 (all), 0 (none) or > 0, got {max_depth}")
        super().__init__(max_depth, **summarize_kwargs)

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        from rich import get_console
        from rich.table import Table

        names = dict(summary_data)["Name"]
        keep = [i for i, name in enumerate(names) if not name.startswith(HIDDEN_PREFIXES)]
        columns = [(title, [values[i] for i in keep]) for title, values in summary_data if title not in HIDDEN_COLUMNS]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for title, _ in columns:
            right = title in ("Params", "Params per Device", "In sizes", "Out sizes")
            table.add_column(" " if title == " " else title, justify="right" if right else "left",
                             style="dim" if title == " " else None, no_wrap=title == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        frozen = total_parameters - trainable_parameters
        console.print(f"[bold]Trainable params[/]: {get_human_readable_count(int(trainable_parameters)).strip()}   "
                      f"[bold]Non-trainable params[/]: {get_human_readable_count(int(frozen)).strip()}   "
                      f"[bold]Total params[/]: {get_human_readable_count(int(total_parameters)).strip()}   "
                      f"[bold]Size (MB)[/]: {get_formatted_model_size(model_size)}")
