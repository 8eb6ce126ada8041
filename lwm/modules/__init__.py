"""Pure-PyTorch model code: no Lightning, no logging. Modules return results and detached logs."""
