"""Provisioner plugins: the protocol they implement and how they are found."""
