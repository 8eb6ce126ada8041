"""Using a trained model: code dictionaries, generation, the learning study."""
