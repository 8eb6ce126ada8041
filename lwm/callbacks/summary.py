"""The rich model summary without Lightning's FLOPs column, which reads 0 without an ``example_input_array``
(:class:`~lwm.callbacks.flop_counter.FlopCounter` prints the real step's), and without the metrics' rows."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from lwm.utils.errors import ConfigError


class ModelSummary(RichModelSummary):
    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if max_depth < -1:
            raise ConfigError(f"model_summary.max_depth must be -1 (all), 0 (none) or > 0, got {max_depth}")
        super().__init__(max_depth, **summarize_kwargs)

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        from rich import get_console
        from rich.table import Table

        keep = [i for i, name in enumerate(dict(summary_data)["Name"]) if not name.startswith("val_metrics")]
        columns = [(title, [values[i] for i in keep]) for title, values in summary_data if title != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for title, _ in columns:
            right = title in ("Params", "Params per Device", "In sizes", "Out sizes")
            table.add_column(" " if title == " " else title, justify="right" if right else "left",
                             style="dim" if title == " " else None, no_wrap=title == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        count = lambda n: get_human_readable_count(int(n)).strip()  # noqa: E731
        console.print(f"[bold]Trainable params[/]: {count(trainable_parameters)}   [bold]Non-trainable params[/]: "
                      f"{count(total_parameters - trainable_parameters)}   [bold]Total params[/]: "
                      f"{count(total_parameters)}   [bold]Size (MB)[/]: {get_formatted_model_size(model_size)}")
