"""What shows a Run: live charts, the progress bar, Stop, the HTML report."""
