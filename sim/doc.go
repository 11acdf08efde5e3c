// Package sim starts fleets of simulated Talos machines.
package sim
