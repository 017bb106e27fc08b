"""Where prompts come from: offline assets, prompt sources and slices, chat rendering."""
