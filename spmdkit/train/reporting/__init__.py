"""What a run reports: the hooks after each step (`hooks`), metrics files and MFU (`metrics`), the lines a person
reads (`report`)."""
