"""History workers (Ray actors on idle CPUs) keeping per-prompt suffix trees and length
statistics between epochs (RhymeRL). Planned; nothing here is selectable yet."""
