"""Utilities below every other layer: errors, argparse helpers, files, seeds, threads, metrics, videos."""
